"""Priority above the default is the operator's to grant; fair share orders jobs within one priority
(issue 34, finding 10).

Bug: a job's priority was its submitter's own choice, up to +-1000, and ordered before fair share: a
heavy user jumped the queue with `--priority 1000` (and, with `preemptible_below` set, preempted
other users' jobs).

Here Ann has used the box far more lately (her usage is on record before the daemon starts), Bob's
group was granted a ceiling of 5, and one CPU slot is held by root's job at a gate. Ann's
`--priority 1000` (or 1) is refused naming her ceiling, 0; Bob gets 5 and not 6; root is bounded by
`priority_range` alone; below the default is anyone's choice. The queue then reads: priority first,
then fair share (Bob before Ann at equal priority, though she submitted first), then submission.
"""

from __future__ import annotations

import grp
import os
import time
from pathlib import Path

import anyio
import pytest

from ddpd.daemon.contain.identity import Identity
from ddpd.daemon.store.state import StateDB
from ddpd.protocol import JobSpec, JobState

from ..scripts.helpers import gated, wait_waiting_at_gate
from ..scripts.userpython import USER_PYTHON
from ..users import plain_env, submit_as
from .test_shared_box import TIMEOUT, shared_box

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.xdist_group("users"),  # useradd/userdel lock /etc/passwd: one worker at a time
    pytest.mark.skipif(os.geteuid() != 0, reason="a root daemon and real users"),
]


def spec(priority: int) -> JobSpec:
    return JobSpec(task="two-layer", nproc=1, workdir="/tmp", python=USER_PYTHON, environ=plain_env(),
                   priority=priority)


def heavy_user_on_record(state_dir: Path, uid: int) -> None:
    """What a daemon of before saved: `uid` used 10,000 CPU-slot-seconds just now."""
    db = StateDB.open_dir(state_dir)
    try:
        db.run_sync(lambda c: c.execute("INSERT INTO usage (uid, gpu_seconds, cpu_seconds, at) VALUES (?, 0, ?, ?)",
                                        (uid, 10_000.0, time.time())))
    finally:
        db.close()


async def test_a_user_cannot_grant_itself_priority_and_fair_share_orders_within_one(
        users: tuple[Identity, Identity], public_tmp: Path) -> None:
    ann, bob = users
    heavy_user_on_record(public_tmp / "state", ann.uid)
    gate = public_tmp / "gate"
    bobs_group = grp.getgrgid(bob.gid).gr_name
    assert ann.gid != bob.gid and ann.gid not in bob.groups
    config = f'[group_priority_ceilings]\n"{bobs_group}" = 5\n'
    async with shared_box(public_tmp, config, "--cpu-slots", "1") as d:
        held = await d.client.submit(gated(d, gate, name="holds the slot"))
        await wait_waiting_at_gate(d, held)
        with anyio.fail_after(TIMEOUT):
            refused = await submit_as(ann, d, spec(1000))
        assert refused == (f"refused bad_spec: priority: 1000 is above 0, the highest priority uid {ann.uid} may "
                           "ask for: priority above the default is the operator's to grant (priority_ceiling, "
                           "user_priority_ceilings, group_priority_ceilings)"), refused
        assert (await submit_as(ann, d, spec(1))).startswith("refused bad_spec: priority: 1 is above 0")
        assert (await submit_as(bob, d, spec(6))).startswith("refused bad_spec: priority: 6 is above 5")
        ann_first = await submit_as(ann, d, spec(0))
        bob_high = await submit_as(bob, d, spec(5))
        bob_then = await submit_as(bob, d, spec(0))
        ann_low = await submit_as(ann, d, spec(-10))  # below the default: anyone's choice
        root_top = await d.client.submit(d.spec(task="two-layer", priority=1000))  # root: priority_range alone
        order = [root_top, bob_high, bob_then, ann_first, ann_low]
        assert not any(j.startswith("refused") for j in order), order
        views = {j: await d.client.status(j) for j in order}
        assert [views[j].queue_position for j in order] == [1, 2, 3, 4, 5], {j: v.pending for j, v in views.items()}
        assert all(v.state == JobState.QUEUED for v in views.values())
        for job_id in order:
            await d.client.cancel(job_id)
        gate.touch()
        with anyio.fail_after(TIMEOUT):
            assert (await d.client.wait(held)).state == JobState.SUCCEEDED
            for job_id in order:
                assert (await d.client.wait(job_id)).state == JobState.CANCELLED
