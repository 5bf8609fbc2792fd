"""Containment by cgroup v2 with a real daemon: each attempt runs in a cgroup of its own, and its
teardown ends with `cgroup.kill`, which ends what setsid and a double fork took out of the process
group and what cleared its environment (no marker), then removes the cgroup."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import anyio
import pytest

from ddpd.daemon.contain.cgroups import probe

from ..conftest import REPO, DaemonProc, assert_gone, running_daemon, start_daemon, stop_daemon
from ..faults.helpers import await_gone, become_subreaper

pytestmark = pytest.mark.anyio

ESCAPE = str(REPO / "tests" / "scripts" / "escape.py")


def _cgroup_usable() -> str | None:
    support = probe()
    return None if support.usable else f"cgroup v2 is not writable here: {support.reason}"


@pytest.mark.skipif(os.geteuid() != 0, reason="writing the cgroup tree needs root here")
async def test_a_setsid_double_forked_escapee_is_killed_through_the_cgroup(daemon: DaemonProc) -> None:
    if (why := _cgroup_usable()) is not None:
        pytest.skip(why)
    ready = await daemon.wait_log(lambda e: e.get("event") in ("cgroup.ready", "cgroup.unavailable"))
    assert ready["event"] == "cgroup.ready", ready
    jobs_cgroup = Path(ready["path"])
    view = await daemon.run(daemon.spec(script=[ESCAPE], nproc=1, memory=1 << 30, cpus=1.5))
    assert view.state == "SUCCEEDED", view.root_cause
    text = ""
    async with daemon.client.logs(view.id) as chunks:
        async for chunk in chunks:
            text += chunk.text
    escapee = int(text.split("ESCAPEE ", 1)[1].split()[0])
    assert_gone(escapee)
    events = [e async for e in daemon.client.events(view.id)]
    killed = [e for e in events if e.kind == "job.leftover_killed"]
    assert killed and killed[0].data.get("via") == "cgroup" and escapee in killed[0].data["pids"], killed
    spawned = [e for e in events if e.kind == "rank.spawned"]
    assert spawned
    # --mem and --cpus: written where the daemon has the controller, else unavailable with its reason
    [limits] = [e.data for e in events if e.kind == "job.limits"]
    for controller, filename in (("memory", "memory.max"), ("cpu", "cpu.max")):
        if controller in ready["controllers"]:
            assert filename in limits["applied"], limits
        else:
            assert "limit not applied" in limits["unavailable"][controller], limits
    # the attempt's cgroup is gone with it
    assert not await anyio.Path(jobs_cgroup / f"{view.id}-a1").exists()


async def _escapee_of(d: DaemonProc, job_id: str) -> int:
    """Follow the job's log until the script has printed its escapee and hangs (a handshake)."""
    text = ""
    with anyio.fail_after(120):
        async with d.client.logs(job_id, follow=True) as chunks:
            async for chunk in chunks:
                text += chunk.text
                if "HANGING" in text:
                    return int(text.split("ESCAPEE ", 1)[1].split()[0])
    raise AssertionError(f"no escapee reported: {text!r}")


@pytest.mark.skipif(os.geteuid() != 0, reason="writing the cgroup tree needs root here")
async def test_recovery_kills_what_is_left_in_the_cgroup_of_a_killed_daemon(short_tmp: Path) -> None:
    """A daemon killed with SIGKILL leaves an escapee; the next one, on the same state, kills it by
    the attempt's saved cgroup path before anything else, and removes the cgroup."""
    if (why := _cgroup_usable()) is not None:
        pytest.skip(why)
    become_subreaper()  # the killed daemon's orphans come here to be reaped (pid 1 here never reaps)
    state = short_tmp / "state"
    async with anyio.create_task_group() as tg:
        first = await start_daemon(tg, short_tmp, "--gpus", "0", state_dir=state)
        job_id = await first.client.submit(first.spec(script=[ESCAPE, "--hang"], nproc=1))
        escapee = await _escapee_of(first, job_id)
        await stop_daemon(first, signal.SIGKILL)
        tg.cancel_scope.cancel()
    os.kill(escapee, 0)  # it outlived the daemon: nothing but the cgroup knows it now
    async with running_daemon(short_tmp, "--gpus", "0", state_dir=state) as d:
        with anyio.fail_after(60):
            view = await d.client.wait(job_id)
        assert view.reason == "daemon_restart"
        for pid in [escapee, *(r.pid for r in view.ranks if r.pid is not None)]:
            await await_gone(pid, 10)
        events = [e async for e in d.client.events(job_id)]
        killed = [e for e in events if e.kind == "job.leftover_killed" and e.data.get("reason") == "daemon_restart"]
        assert killed and escapee in killed[0].data["pids"], killed
        ready = await d.wait_log(lambda e: e.get("event") == "cgroup.ready")
        assert not await anyio.Path(ready["path"], f"{job_id}-a1").exists()
