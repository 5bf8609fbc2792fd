"""Restarts with resume, and the stop warning before the wall-time limit."""

from __future__ import annotations

import os
import signal

import anyio
import pytest

from ddpd.protocol import JobState

from ..conftest import DaemonProc, assert_nothing_left
from .helpers import events_of, now, report_fault, report_line

pytestmark = pytest.mark.anyio


@pytest.mark.slow
async def test_rank_killed_once_the_job_resumes_and_finishes(daemon: DaemonProc) -> None:
    """A second attempt (new store, new group) resumes from the last checkpoint: same parameters as a
    run that was never interrupted."""
    steps = 40
    reference = await daemon.run(daemon.spec(task="two-layer", nproc=2, steps=steps))
    assert reference.state == JobState.SUCCEEDED
    spec = daemon.spec(task="tests.tasks:slow", nproc=2, steps=steps, max_restarts=1, checkpoint_every=5,
                       options={"step_sleep": 0.1}, hot_replace=0)  # the restart path (not a replacement)
    job_id = await daemon.client.submit(spec)
    saved = await daemon.wait_event(job_id, lambda e: e.kind == "job.checkpointed" and e.data["step"] >= 10)
    first = await daemon.client.status(job_id)
    victim = first.ranks[1].pid
    assert victim is not None
    fault_at = now()
    os.kill(victim, signal.SIGKILL)
    restarting = await daemon.wait_event(job_id, lambda e: e.kind == "job.state_changed"
                                         and e.data.get("to") == "RESTARTING")
    report_line(f"FAULT sigkill-rank (max_restarts 1): {restarting.ts - fault_at:.2f} s to RESTARTING")
    with anyio.fail_after(120):
        job = await daemon.client.wait(job_id)
    report_fault("sigkill-rank, restart and resume", fault_at, job)
    assert job.state == JobState.SUCCEEDED, job.root_cause
    assert job.attempt == 2 and [r.step for r in job.ranks] == [steps, steps]
    assert "rank 1 died of signal SIGKILL" in restarting.data["root_cause"], restarting.data
    assert job.ranks[0].pgid != first.ranks[0].pgid and job.store_port != first.store_port
    events = await events_of(daemon, job_id)
    resumed = [e.data["step"] for e in events if e.kind == "job.checkpointed" and e.attempt == 2]
    last_saved = max(e.data["step"] for e in events if e.kind == "job.checkpointed" and e.attempt == 1)
    assert last_saved >= saved.data["step"] and resumed and min(resumed) > last_saved, (last_saved, resumed)
    # the loss curve continues: the parameters end exactly where an uninterrupted run's do
    assert job.ranks[0].checksum == reference.ranks[0].checksum
    assert_nothing_left([reference, first, job])


@pytest.mark.slow
async def test_wall_time_warning_lets_ranks_checkpoint(daemon: DaemonProc) -> None:
    """`stop_warning` seconds before the wall time the ranks get a Stop; they checkpoint and exit 0;
    the job ends TIMED_OUT (wall_time) without a signal and is not restarted."""
    spec = daemon.spec(task="tests.tasks:slow", nproc=2, steps=1_000_000, max_restarts=1,
                       options={"step_sleep": 0.05}, timeouts={"wall": 30.0, "stop_warning": 10.0})
    job_id = await daemon.client.submit(spec)
    warning = await daemon.wait_event(job_id, lambda e: e.kind == "job.stop_warning")
    assert warning.data["reason"] == "wall_time_warning" and 9 < warning.data["seconds_left"] <= 10
    with anyio.fail_after(60):
        job = await daemon.client.wait(job_id)
    report_fault("wall-time warning (stop_warning 10 s)", warning.ts, job)
    assert job.state == JobState.TIMED_OUT and job.reason == "wall_time"
    assert job.attempt == 1
    assert job.root_cause is not None and "wall-time warning" in (job.root_cause.detail or "")
    assert [(r.exit_code, r.signal) for r in job.ranks] == [(0, None), (0, None)]
    events = await events_of(daemon, job_id)
    saved = [e for e in events if e.kind == "job.checkpointed"]
    assert saved and saved[-1].ts > warning.ts and saved[-1].data["step"] == job.ranks[0].step
    assert not any(e.kind == "job.teardown" for e in events)
    assert job.finished_at is not None and job.started_at is not None
    assert job.finished_at - job.started_at < 30
    assert_nothing_left([job])
