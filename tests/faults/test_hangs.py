"""Hangs: diagnosed with stack dumps before the teardown, and nothing left behind."""

from __future__ import annotations

import os
import signal
import stat
from pathlib import Path

import anyio
import pytest

from ddpd.daemon.layout import stderr_log
from ddpd.protocol import JobState

from ..conftest import DaemonProc, assert_nothing_left
from .helpers import events_of, now, report_fault, report_line, wait_while_pinging

pytestmark = pytest.mark.anyio


def _log(path: str | None) -> str:
    """A rank's stderr (``rank-<r>.err`` beside its log), where its stack dumps go."""
    assert path is not None
    return Path(stderr_log(path)).read_text(errors="replace")


async def test_rank_stuck_while_its_peer_waits_in_a_collective(daemon: DaemonProc) -> None:
    """Rank 1 blocks in Python at step 3 while its heartbeat thread keeps beating; rank 0 waits in all_reduce.

    Only the progress timeout can see it; both ranks' stacks are dumped into their logs first.
    """
    spec = daemon.spec(task="tests.tasks:hang_in_training", nproc=2, steps=1000,
                       options={"rank": 1, "at_step": 3}, timeouts={"progress": 6.0, "kill_grace": 2.0})
    job_id = await daemon.client.submit(spec)
    last = await daemon.wait_event(job_id, lambda e: e.kind in ("rank.progress", "job.finished"))
    assert last.kind == "rank.progress", await events_of(daemon, job_id)
    with anyio.fail_after(60):
        job = await daemon.client.wait(job_id)
    report_fault("hang-in-collective (progress 6 s)", last.ts, job)
    assert job.state == JobState.TIMED_OUT, job.root_cause
    rc = job.root_cause
    assert rc is not None and rc.reason == "progress_timeout", rc
    assert rc.rank == 1, rc  # the stuck rank, not the one waiting for it in all_reduce
    assert "tests/tasks.py" in (rc.detail or ""), rc
    assert all(r.stack_dump for r in job.ranks), job.ranks
    stuck = _log(job.ranks[1].log)
    assert "Thread 0x" in stuck and "in on_step" in stuck and "tests/tasks.py" in stuck
    events = await events_of(daemon, job_id)
    dumped = next(e for e in events if e.kind == "job.stacks_dumped")
    assert dumped.data["ranks"] == [0, 1]
    where = dumped.data["where"]
    assert where["1"].startswith("rank 1 stuck at") and "tests/tasks.py" in where["1"], where
    # its peer is blocked inside torch: in DDP's gradient all-reduce (backward) or the stop vote
    assert where["0"].startswith("rank 0 waiting in torch"), where
    assert "src/ddpd/worker/loop.py" in where["0"] and "Thread 0x" in _log(job.ranks[0].log)
    kinds = [e.kind for e in events]
    assert kinds.index("job.stacks_dumped") < kinds.index("job.teardown")
    assert_nothing_left([job])


@pytest.mark.slow
async def test_rank_stuck_before_init_process_group(daemon: DaemonProc) -> None:
    """Rank 1 hangs in its task factory (before the store); rank 0 waits in init_process_group."""
    spec = daemon.spec(task="tests.tasks:hang_before_join", nproc=2, options={"rank": 1},
                       timeouts={"join": 20.0, "kill_grace": 2.0})
    job_id = await daemon.client.submit(spec)
    hello = await daemon.wait_event(job_id, lambda e: e.kind == "rank.connected" and e.rank == 1)
    # (the fault: from rank 1's hello on it hangs; the join timeout counts from the spawn)
    with anyio.fail_after(60):
        job = await daemon.client.wait(job_id)
    report_fault("hang-before-join (join 20 s)", hello.ts, job)
    assert job.state == JobState.TIMED_OUT
    rc = job.root_cause
    assert rc is not None and rc.reason == "join_timeout" and rc.ranks == [1], rc
    assert rc.phase == "CONNECTED"
    assert "tests/tasks.py" in (rc.detail or ""), rc
    assert all(r.stack_dump for r in job.ranks), job.ranks
    stuck = _log(job.ranks[1].log)
    assert "in hang_before_join" in stuck and "tests/tasks.py" in stuck
    waiting = _log(job.ranks[0].log)
    assert "in init_process_group" in waiting or "in connect" in waiting
    assert_nothing_left([job])


async def test_stopped_rank_is_caught_by_the_heartbeat_timeout(daemon: DaemonProc) -> None:
    """SIGSTOP freezes every thread of rank 1, its heartbeat thread too: the heartbeat timeout fires."""
    spec = daemon.spec(task="tests.tasks:slow", nproc=2, steps=100_000, options={"step_sleep": 0.01},
                       timeouts={"heartbeat": 3.0, "kill_grace": 2.0})
    job_id = await daemon.client.submit(spec)
    await daemon.wait_event(job_id, lambda e: e.kind == "rank.progress" and e.data["step"] >= 2)
    view = await daemon.client.status(job_id)
    victim = view.ranks[1].pid
    assert victim is not None
    fault_at = now()
    os.kill(victim, signal.SIGSTOP)
    with anyio.fail_after(60):
        job = await daemon.client.wait(job_id)
    report_fault("sigstop-rank (heartbeat 3 s)", fault_at, job)
    assert job.state == JobState.TIMED_OUT
    rc = job.root_cause
    assert rc is not None and rc.reason == "heartbeat_timeout" and rc.rank == 1, rc
    assert job.ranks[0].stack_dump
    assert_nothing_left([job])


async def test_rank_log_replaced_by_a_fifo_does_not_freeze_the_daemon(daemon: DaemonProc) -> None:
    """Bug: a job that replaced its own rank log by a FIFO and then hung froze the event loop (the
    stack-dump step opened the log on the loop thread): ping went unanswered for 68 s. Job files are
    read off the loop, non-blocking and regular files only: the job is torn down, ping keeps answering."""
    spec = daemon.spec(task="tests.tasks:fifo_log_then_hang", nproc=2, steps=100_000,
                       options={"rank": 1, "at_step": 3, "step_sleep": 0.02},
                       timeouts={"progress": 4.0, "kill_grace": 2.0})
    job_id = await daemon.client.submit(spec)
    await daemon.wait_event(job_id, lambda e: e.kind == "rank.progress")
    job, pinger = await wait_while_pinging(daemon, job_id)
    report_line(f"FIFO rank log: worst ping {pinger.worst * 1000:.1f} ms over {pinger.count} pings")
    assert pinger.count > 0
    assert job.state == JobState.TIMED_OUT, job.root_cause
    rc = job.root_cause
    # rank 1's stack dump cannot be read (its log is a FIFO), so both frozen ranks are named
    assert rc is not None and rc.reason == "progress_timeout" and 1 in (rc.ranks or []), rc
    assert stat.S_ISFIFO(os.lstat(stderr_log(job.ranks[1].log or "")).st_mode)
    await daemon.client.ping()
    assert_nothing_left([job])
