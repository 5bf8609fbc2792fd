"""A user's interpreter that is a hostile shell wrapper, on a root daemon serving two users (useradd).

The daemon runs a user's interpreter in three places: the interpreter check at submit, the cold
rank, and the warm pool's member of the user's key (a fork server or a whole interpreter, started
through the wrapper as the cold rank is). The wrapper here backgrounds a `setsid` process (a new
session: out of every process group the daemon kills) and then stalls or never runs python. Each
test asserts that what the wrapper left dies with the cgroup of what started it (the check, the
attempt, the pool member) when that ends, that one user's slow checks never hold another user's,
and that nothing is left: no process, no cgroup.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import anyio
import pytest

from ddpd.daemon.contain.cgroups import Cgroup, probe
from ddpd.daemon.contain.identity import Identity
from ddpd.protocol import JobState, RemoteError

from ..conftest import DaemonProc
from ..scripts.userpython import USER_PYTHON
from ..users import submit_as
from .test_shared_box import TIMEOUT, eventually, pings, processes_with, script_spec, shared_box

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.xdist_group("users"),  # useradd/userdel lock /etc/passwd: one worker at a time
    pytest.mark.skipif(os.geteuid() != 0, reason="a shared box needs a root daemon and real users"),
]


def check_cgroups() -> list[Path]:
    support = probe()
    if support.path is None:
        return []
    return [p for pattern in ("*/check-*", "*/*/check-*") for p in support.path.glob(pattern)]


def in_pool_cgroup(pid: int) -> bool:
    """Whether `pid` is in a pool member's cgroup (``pool-*``), or gone already."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return True
    return any(line.startswith("0::") and Path(line[3:]).name.startswith("pool-") for line in lines)


def pooled(d: DaemonProc) -> bool:
    return any(e.get("event") == "pool.started" for e in d.logs)


def _slow_wrapper(base: Path, tag: str) -> Path:
    """An interpreter of Ann's that leaves a `setsid` process behind and waits for `base/gate` first."""
    path = base / "slow-python"
    path.write_text(f"#!/bin/sh\nsetsid sleep {tag} </dev/null >/dev/null 2>&1 &\n"
                    f"while [ ! -e {base}/gate ]; do sleep 0.05; done\nexec {USER_PYTHON} \"$@\"\n")
    path.chmod(0o755)
    return path


def _stuck_wrapper(base: Path, tag: str) -> Path:
    """An interpreter of Ann's that runs python for everything but a pool member: for that it
    leaves a `setsid` process behind and sleeps, never saying Hello."""
    wrapper = base / "stuck-python"
    wrapper.write_text(f"#!/bin/sh\ncase \" $* \" in *\" --pool \"*)\n"
                       f"  setsid sleep {tag} </dev/null >/dev/null 2>&1 &\n  exec sleep {tag};;\nesac\n"
                       f"exec {USER_PYTHON} \"$@\"\n")
    wrapper.chmod(0o755)
    return wrapper


async def _job_beside_stuck_member(ann: Identity, d: DaemonProc, wrapper: Path) -> dict[str, Any]:
    """Ann's first job through her stuck wrapper (a script printing ``ok``): it succeeds, its rank
    cold; the `pool.worker_spawned` line of the pool member of her key it started (that never says
    Hello)."""
    quick = wrapper.parent / "quick.py"
    quick.write_text("print('ok')\n")
    job_id = await submit_as(ann, d, script_spec(str(quick), python=str(wrapper)))
    assert not job_id.startswith("refused"), job_id
    with anyio.fail_after(TIMEOUT):
        assert (await d.client.wait(job_id)).state == JobState.SUCCEEDED  # a cold rank runs python
    return await d.wait_log(lambda e: e.get("event") == "pool.worker_spawned" and e.get("uid") == ann.uid, 60)


async def test_interpreter_checks_are_contained_and_one_users_do_not_hold_anothers(
    users: tuple[Identity, Identity], public_tmp: Path
) -> None:
    """Bug: the check ran user code outside any cgroup (a `setsid` child of it outlived the job, the
    daemon and its recovery), and its slots were daemon-wide: 8 slow checks of one user made
    another user's submit wait 32 s."""
    ann, bob = users
    if not probe().usable:
        pytest.skip("cgroup v2 is not writable here: checks cannot have cgroups of their own")
    tag = f"3{os.getpid() % 1000:03d}.5"  # a `sleep` duration no other process uses
    slow = _slow_wrapper(public_tmp, tag)
    quick = public_tmp / "quick.py"
    quick.write_text("print('ok')\n")
    # a short pool_idle_expiry: with a pool, Ann's key is forgotten (its member retired) soon after her jobs
    async with shared_box(public_tmp, "interpreter_checks_per_user = 2\npool_idle_expiry = 2.0\n") as d:
        results: list[str] = []
        async with anyio.create_task_group() as tg:
            async def hers() -> None:
                results.append(await submit_as(ann, d, script_spec(str(quick), python=str(slow))))

            for _ in range(3):
                tg.start_soon(hers)
            # two of hers are in their checks (the third waits its turn)
            await eventually(lambda: len(processes_with(f"sleep {tag}")) >= 2, 60)
            assert len(processes_with(f"sleep {tag}")) == 2
            with anyio.fail_after(90):  # his check runs meanwhile: import torch, on a loaded machine
                his = await submit_as(bob, d, script_spec(str(quick)))
            assert not his.startswith("refused"), his
            assert results == []
            (public_tmp / "gate").touch()
        assert len(results) == 3 and not any(r.startswith("refused") for r in results), results
        for job_id in [*results, his]:
            with contextlib.suppress(RemoteError):  # it may have ended already
                await d.client.cancel(job_id)
        for job_id in [*results, his]:
            with anyio.fail_after(TIMEOUT):
                await d.client.wait(job_id)
        left = processes_with(f"sleep {tag}")
        if not pooled(d):
            assert left == []  # each ended with its check's cgroup (or its attempt's)
        else:
            # Each check's and each attempt's escapee ended with its cgroup; but a pooled daemon also
            # started Ann's wrapper for her key's pool member (as her cold rank was), and that escapee
            # lives in the member's cgroup while the member does: what must hold is that the member's
            # end kills it. Her key is forgotten pool_idle_expiry after her last job, its member retired.
            assert all(in_pool_cgroup(pid) for pid in left), left
            await d.wait_log(lambda e: e.get("event") == "pool.key_expired"
                             and str(e.get("key")).startswith(f"uid {ann.uid} "), 60)
            await eventually(lambda: processes_with(f"sleep {tag}") == [], 30)
        # a check's cgroup is removed off the loop once it has emptied: wait for that, bounded
        await eventually(lambda: check_cgroups() == [], 30)


@pytest.mark.parametrize("fork_server", [True, False], ids=["fork-server", "interpreters"])
async def test_a_pool_member_whose_wrapper_never_runs_python_is_retired_with_its_key(
    users: tuple[Identity, Identity], public_tmp: Path, fork_server: bool
) -> None:
    """Bug: a pool member that never said Hello (a wrapper that backgrounds a `setsid` process and never
    execs python when started for the pool) was never retired: its key was forgotten, and the member
    and its escapee stayed until the daemon stopped, holding a refill's core all along."""
    ann, _ = users
    if not probe().usable:
        pytest.skip("cgroup v2 is not writable here: pool members of other users need cgroups")
    tag = f"4{os.getpid() % 1000:03d}.5"  # a `sleep` duration no other process uses
    wrapper = _stuck_wrapper(public_tmp, tag)
    config = f"pool_idle_expiry = 15.0\npool_fork_server = {str(fork_server).lower()}\n"
    async with shared_box(public_tmp, config, "--pool-size", "2") as d:
        member = await _job_beside_stuck_member(ann, d, wrapper)
        await eventually(lambda: len(processes_with(f"sleep {tag}")) == 2, 30)  # the member and its escapee
        retired = await d.wait_log(lambda e: e.get("event") == "pool.worker_retired"
                                   and e.get("pid") == member["pid"], 60)
        assert retired.get("starting") is True, retired
        await eventually(lambda: processes_with(f"sleep {tag}") == [], 30)  # its cgroup's end killed both
        assert not [e for e in d.logs if e.get("event") == "pool.worker_failed" and e.get("pid") == member["pid"]]
        await pings(ann, d)


@pytest.mark.parametrize("fork_server", [True, False], ids=["fork-server", "interpreters"])
async def test_a_pool_member_not_ready_within_its_start_timeout_is_killed_and_its_key_backs_off(
    users: tuple[Identity, Identity], public_tmp: Path, fork_server: bool
) -> None:
    """Bug: a pool member that never said Hello lived while its key was used (its jobs started cold
    meanwhile), holding a pool slot of its user's share, its memory and its escapee's. Now a member
    not ready within `pool_start_timeout` s in which no job held cores is killed with its cgroup,
    as a failure, and the key backs off; the key stays known, so a later member is tried."""
    ann, _ = users
    if not probe().usable:
        pytest.skip("cgroup v2 is not writable here: pool members of other users need cgroups")
    tag = f"5{os.getpid() % 1000:03d}.5"  # a `sleep` duration no other process uses
    wrapper = _stuck_wrapper(public_tmp, tag)
    config = f"pool_start_timeout = 2.0\npool_fork_server = {str(fork_server).lower()}\n"
    async with shared_box(public_tmp, config, "--pool-size", "2") as d:
        member = await _job_beside_stuck_member(ann, d, wrapper)
        failed = await d.wait_log(lambda e: e.get("event") == "pool.worker_failed" and e.get("pid") == member["pid"],
                                  60)
        assert failed["reason"] == "not ready within pool_start_timeout (2 s)", failed
        assert failed["exit"] == "signal SIGKILL", failed
        backoff = await d.wait_log(lambda e: e.get("event") == "pool.backoff"
                                   and str(e.get("key")).startswith(f"uid {ann.uid} "), 10)
        assert backoff["failures"] == 1, backoff
        # its cgroup's end killed its escapee too; the key is still known: after the backoff, another try
        await eventually(lambda: member["pid"] not in processes_with(f"sleep {tag}"), 30)
        await d.wait_log(lambda e: e.get("event") == "pool.worker_spawned" and e.get("uid") == ann.uid
                         and e.get("pid") != member["pid"], 60)
        assert not [e for e in d.logs if e.get("event") == "pool.key_expired"]
        await pings(ann, d)
    await eventually(lambda: processes_with(f"sleep {tag}") == [], 30)  # the daemon's stop ended the rest


async def test_a_check_a_killed_daemon_left_is_ended_at_the_next_start(
    users: tuple[Identity, Identity], public_tmp: Path
) -> None:
    """What a check left running when the daemon was killed (its cgroup, a process of the user's in
    it) is killed and removed when the daemon starts again, before it serves anyone."""
    ann, _ = users
    if not probe().usable:
        pytest.skip("cgroup v2 is not writable here: checks cannot have cgroups of their own")
    async with shared_box(public_tmp) as d:
        jobs = Path((await d.wait_log(lambda e: e.get("event") == "cgroup.ready"))["path"])
    os.makedirs(jobs, exist_ok=True)  # a daemon alone under the root cgroup removed its own at its stop
    left = Cgroup.create(jobs, f"check-{ann.uid}-1")
    proc = await anyio.open_process(["sleep", "600"], user=ann.uid, group=ann.gid, extra_groups=[])
    try:
        left.add(proc.pid)
        async with shared_box(public_tmp) as d:
            with anyio.fail_after(30):
                await proc.wait()  # killed with its cgroup, at the start
            assert proc.returncode == -9
            assert not left.path.exists()
            await pings(ann, d)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        left.kill(10)
        left.remove()
