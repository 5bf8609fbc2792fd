"""No orphans, whatever dies: the daemon (kill -9, then recovery), a rank's children, a rank deaf to SIGTERM."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import anyio
import pytest

from ddpd.protocol import JobState

from ..conftest import DaemonProc, assert_nothing_left, start_daemon, stop_daemon
from .helpers import (
    assert_alive_in_job,
    await_gone,
    become_subreaper,
    child_pids,
    events_of,
    now,
    report_fault,
    report_line,
    wait_rank_log,
)

pytestmark = pytest.mark.anyio


async def test_grandchildren_die_with_the_job(daemon: DaemonProc) -> None:
    """Each rank starts `sleep` in its group and a setsid() escapee: teardown kills both (marker DDPD_ATTEMPT)."""
    spec = daemon.spec(task="tests.tasks:spawn_children_reporting", nproc=2, steps=100_000,
                       options={"step_sleep": 0.02}, timeouts={"kill_grace": 3.0})
    job_id = await daemon.client.submit(spec)
    await daemon.wait_event(job_id, lambda e: e.kind == "rank.progress")
    view = await daemon.client.status(job_id)
    children = [pid for r in view.ranks for pid in child_pids(r.log or "")]
    assert len(children) == 4
    for pid in children:  # the orphans to be: each running, and the job's
        assert_alive_in_job(pid, job_id)
    fault_at = now()
    await daemon.client.cancel(job_id)
    with anyio.fail_after(60):
        job = await daemon.client.wait(job_id)
    report_fault("grandchildren (cancel, setsid escapee)", fault_at, job)
    assert job.state == JobState.CANCELLED, job.root_cause
    killed = next(e for e in await events_of(daemon, job_id) if e.kind == "job.leftover_killed")
    assert set(children) <= set(killed.data["pids"]), (children, killed.data)
    for pid in children:
        await await_gone(pid, 10)
    assert_nothing_left([job])


async def test_rank_ignoring_sigterm_is_killed_after_the_grace(daemon: DaemonProc) -> None:
    """Cancel asks for a graceful stop; rank 1 is stuck and every rank ignores SIGTERM: SIGKILL ends them.

    Bug: the stop and SIGTERM each waited a whole grace (4.05 s with a 2 s grace); they share one deadline.
    """
    spec = daemon.spec(task="tests.tasks:hang_ignoring_sigterm", nproc=2, steps=100_000,
                       options={"rank": 1, "at_step": 3}, timeouts={"kill_grace": 2.0})
    job_id = await daemon.client.submit(spec)
    await wait_rank_log(daemon, job_id, 1, "HANGING at step 3")
    fault_at = now()
    await daemon.client.cancel(job_id)
    with anyio.fail_after(60):
        job = await daemon.client.wait(job_id)
    seconds = report_fault("ignore-sigterm (cancel, grace 2 s)", fault_at, job)
    assert job.state == JobState.CANCELLED
    assert [r.signal for r in job.ranks] == ["SIGKILL", "SIGKILL"], job.ranks
    events = await events_of(daemon, job_id)
    steps = [(e.kind, e.data.get("signal")) for e in events if e.kind in ("job.stop_requested", "job.teardown")]
    assert steps == [("job.stop_requested", None), ("job.teardown", "SIGTERM"), ("job.teardown", "SIGKILL")]
    torn_down = next(e for e in events if e.kind == "job.torn_down")
    assert 2.0 <= torn_down.data["seconds"] < 1.6 * 2.0, torn_down.data  # one grace, not two
    assert seconds < 1.6 * 2.0 + 2.0  # from the cancel to the final state (a loaded machine's margin)
    assert_nothing_left([job])


@pytest.mark.slow
async def test_daemon_killed_then_recovered(short_tmp: Path) -> None:
    """kill -9 the daemon with two jobs running and two queued; every worker dies within 2 s; a restart
    on the same state dir kills what is left (grandchildren, checked against /proc), fails the job
    without restarts left (`daemon_restart`), requeues the one with a restart left (it resumes from
    its checkpoint), and runs the queued ones."""
    become_subreaper()  # the daemon's orphans come here, not to a pid 1 that never reaps
    async with anyio.create_task_group() as tg:
        d = await start_daemon(tg, short_tmp, "--cpu-slots", "3")
        try:
            doomed = await d.client.submit(d.spec(task="tests.tasks:spawn_children_reporting", nproc=2,
                                                  steps=100_000, options={"step_sleep": 0.02}))
            resumable = await d.client.submit(d.spec(task="tests.tasks:slow", nproc=1, steps=60,
                                                     max_restarts=1, checkpoint_every=5,
                                                     options={"step_sleep": 0.1}))
            queued = [await d.client.submit(d.spec(task="two-layer", nproc=1, steps=5)) for _ in range(2)]
            await d.wait_event(doomed, lambda e: e.kind == "rank.progress")
            checkpoint = await d.wait_event(resumable, lambda e: e.kind == "job.checkpointed")
            views = [await d.client.status(j) for j in (doomed, resumable)]
            assert [v.state for v in views] == ["RUNNING", "RUNNING"]
            assert [(await d.client.status(j)).state for j in queued] == ["QUEUED", "QUEUED"]
            workers = [r.pid for v in views for r in v.ranks if r.pid is not None]
            children = [pid for r in views[0].ranks for pid in child_pids(r.log or "")]
            assert len(children) == 4, children
            for pid in children:
                assert_alive_in_job(pid, doomed)
            killed_at, killed_wall = time.monotonic(), now()
            d.proc.send_signal(signal.SIGKILL)
            # reaped first: until the daemon has fully exited, a worker that died at once may still
            # be the dying daemon's zombie rather than ours to reap
            with anyio.fail_after(10):
                await d.proc.wait()
            for pid in workers:
                await await_gone(pid, 2.0)
            report_line(f"FAULT daemon-sigkill: {time.monotonic() - killed_at:.2f} s until all "
                        f"{len(workers)} workers were gone")
            for pid in children[1::2]:  # the setsid escapees: orphans now, for the restart to find
                assert_alive_in_job(pid, doomed)
            await stop_daemon(d)
        finally:
            if d.proc.returncode is None:
                d.proc.kill()

        d = await start_daemon(tg, short_tmp, "--cpu-slots", "3", state_dir=d.state_dir)
        try:
            failed = await d.client.status(doomed)
            assert failed.state == JobState.FAILED and failed.reason == "daemon_restart"
            assert failed.root_cause is not None and failed.root_cause.reason == "daemon_restart"
            # from the kill to FAILED, a daemon restart (about its start-up time) included
            report_fault("daemon-sigkill, then restart (job without restarts left)", killed_wall, failed)
            killed = next(e for e in await events_of(d, doomed) if e.kind == "job.leftover_killed")
            # the setsid escapees outlive their ranks until this restart; a rank's in-group child may
            # already have gone with its group (a rank that read its channel's end before pdeathsig
            # struck kills its own group) or be killed here: nothing outside the job is ever signalled
            escapees = children[1::2]
            assert set(escapees) <= set(killed.data["pids"]) <= set(children), (children, killed.data)
            for pid in children:
                await await_gone(pid, 10)
            with anyio.fail_after(180):
                jobs = [await d.client.wait(j) for j in (resumable, *queued)]
            assert [j.state for j in jobs] == ["SUCCEEDED"] * 3, [j.root_cause for j in jobs]
            resumed = jobs[0]
            assert resumed.attempt == 2 and resumed.ranks[0].step == 60
            events = await events_of(d, resumable)
            requeue = [e for e in events if e.kind == "job.state_changed" and e.data.get("to") == "QUEUED"]
            assert requeue and requeue[-1].data["reason"] == "daemon_restart"
            # attempt 2 started from the last checkpoint of attempt 1, not from step 0
            assert checkpoint.data["step"] >= 5
            ckpts = [e.data["step"] for e in events if e.kind == "job.checkpointed" and e.attempt == 2]
            assert ckpts and min(ckpts) > checkpoint.data["step"], ckpts
            assert_nothing_left([failed, *jobs])
        finally:
            assert await stop_daemon(d) == 0
        tg.cancel_scope.cancel()
