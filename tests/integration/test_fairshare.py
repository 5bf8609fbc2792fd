"""Fair share between users (real daemon, real users, real ranks): among jobs of equal priority, the user
who used the box less lately goes first, and usage outlives a daemon restart.

One CPU slot, so jobs run one at a time. Alice's first job holds the slot at a gate while she queues
19 more (20 in all) and Bob then queues two; once the gate opens, Bob's two start within Alice's next
two (in submission order, as before fair share, all 19 of Alice's would go first). Alice's jobs still
queued once Bob's are done are cancelled.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from ddpd.daemon.contain.identity import Identity
from ddpd.protocol import JobSpec, JobState

from ..conftest import DaemonProc, assert_nothing_left, running_daemon
from ..scripts.helpers import state_is, wait_waiting_at_gate
from ..scripts.userpython import USER_PYTHON, user_pythonpath
from ..users import submit_as
from .test_cli import DDPCTL

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.xdist_group("users"),  # useradd/userdel lock /etc/passwd: one worker at a time
    pytest.mark.skipif(os.geteuid() != 0, reason="two users' jobs need a root daemon (useradd)"),
]

TIMEOUT = 240
ALICE_MORE = 19  # Alice's jobs queued behind her first
def spec(name: str, **kw: object) -> JobSpec:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": user_pythonpath(), "HOME": "/tmp"}
    fields: dict[str, object] = {"task": "two-layer", "steps": 2, "nproc": 1, "name": name, "workdir": "/tmp",
                                 "python": USER_PYTHON, "environ": env, **kw}
    return msgspec.convert(fields, JobSpec)


async def ddpctl(d: DaemonProc, *args: str) -> str:
    """What `ddpctl ARGS` prints (a real client process, 200 columns wide)."""
    with anyio.fail_after(60):
        done = await anyio.run_process([DDPCTL, "--socket", str(d.socket), *args], check=False,
                                       stdin=subprocess.DEVNULL, env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 0, done.stderr.decode()
    return done.stdout.decode()


def shared_daemon(base: Path) -> Any:
    config = base / "ddpd.toml"
    config.write_text('socket_mode = "0666"\n')
    return running_daemon(base, "--config", str(config), "--gpus", "0", "--cpu-slots", "1", "--pool-size", "0",
                          state_dir=base / "state")


async def test_the_user_who_used_less_goes_first_and_usage_survives_a_restart(
        users: tuple[Identity, Identity], public_tmp: Path) -> None:
    alice, bob = users
    gate = public_tmp / "gate"
    async with shared_daemon(public_tmp) as d:
        first, *more = [await submit_as(alice, d, s) for s in [
            spec("a0", task="tests.scripts.gated:make_task", options={"gate": str(gate)}),
            *(spec(f"a{i}") for i in range(1, ALICE_MORE + 1))]]
        await wait_waiting_at_gate(d, first)
        bobs = [await submit_as(bob, d, spec(name)) for name in ("b1", "b2")]
        waiting = await d.client.status(bobs[0])
        assert waiting.state == JobState.QUEUED and waiting.queue_position == 1, waiting  # ahead of Alice's
        gate.touch()
        with anyio.fail_after(TIMEOUT):
            bobs_done = [await d.client.wait(j) for j in bobs]
        assert [v.state for v in bobs_done] == [JobState.SUCCEEDED] * 2, [v.root_cause for v in bobs_done]
        for job_id in more:  # the rest of Alice's flood is not needed
            if (await d.client.status(job_id)).state == JobState.QUEUED:
                await d.client.cancel(job_id)
        with anyio.fail_after(TIMEOUT):
            done = [await d.client.wait(j) for j in (first, *more, *bobs)]
        assert {v.state for v in done} <= {JobState.SUCCEEDED, JobState.CANCELLED}, [v.root_cause for v in done]
        assert done[0].state == JobState.SUCCEEDED
        async with d.client.events() as stream:
            starts = [e.job_id async for e in stream if state_is("STARTING")(e)]
        after_gate = starts[starts.index(first) + 1:]
        alice_before_bob = sum(1 for j in after_gate[:max(after_gate.index(b) for b in bobs)] if j in more)
        assert alice_before_bob <= 2, after_gate
        shares = {v.uid: v for v in (await d.client.share()).users}
        assert shares[alice.uid].cpu_seconds > shares[bob.uid].cpu_seconds > 0, shares
        assert (shares[alice.uid].running, shares[alice.uid].queued) == (0, 0)
        table = await ddpctl(d, "share")
        assert table.index(f"{bob.name} ({bob.uid})") < table.index(f"{alice.name} ({alice.uid})"), table  # next first
        assert "share" in (await ddpctl(d, "ls")).splitlines()[1], "ls has a share column"
        assert_nothing_left(done)
    async with shared_daemon(public_tmp) as d:
        again = {v.uid: v for v in (await d.client.share()).users}
        for uid in (alice.uid, bob.uid):  # kept (a week's half-life: decayed by a hair)
            assert again[uid].cpu_seconds == pytest.approx(shares[uid].cpu_seconds, rel=0.01), (again, shares)
