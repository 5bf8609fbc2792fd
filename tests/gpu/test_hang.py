"""The hang path under NCCL: a rank stuck before a collective is named, its stacks dumped, the job torn
down, and nothing of it left on any GPU."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from ddpd.protocol import JobState
from ddpd.protocol.control import JobView

from ..conftest import DaemonProc, assert_nothing_left
from .conftest import GpuWatch, gpu_count, log_of

pytestmark = pytest.mark.anyio


async def test_rank_stuck_before_a_collective_under_nccl(gpu_daemon: DaemonProc, gpu_watch: GpuWatch) -> None:
    """With two GPUs rank 1 hangs at step 3 while rank 0 waits in NCCL, and rank 0's flight recorder
    is dumped (a non-empty file beside the logs); with one GPU the only rank hangs (NCCL cannot put
    two ranks on one GPU)."""
    d = gpu_daemon
    nproc = min(2, gpu_count())
    stuck = nproc - 1
    spec = d.spec(task="tests.tasks:hang_in_training", nproc=nproc, steps=1000, device="cuda", backend="nccl",
                  options={"rank": stuck, "at_step": 3}, timeouts={"progress": 15.0, "kill_grace": 3.0})
    job_id = await d.client.submit(spec)
    await d.wait_event(job_id, lambda e: e.kind == "rank.progress")
    running = await d.client.status(job_id)  # past step 1: every rank holds its CUDA context
    seen = await gpu_watch.saw_ranks(running)
    with anyio.fail_after(120):
        job = await d.client.wait(job_id)
    assert job.state == JobState.TIMED_OUT, job.root_cause
    rc = job.root_cause
    assert rc is not None and rc.reason == "progress_timeout" and rc.rank == stuck, rc
    assert all(r.stack_dump for r in job.ranks), job.ranks
    text = log_of(job, stuck)
    assert "HANGING at step 3" in text and "Thread 0x" in text and "in on_step" in text
    if nproc == 2:  # rank 0 waited in an NCCL collective: its flight recorder was dumped beside the logs
        dumps = sorted(Path(rank_log(job, 0)).parent.glob("nccl-trace-rank-*"))
        assert dumps and all(p.stat().st_size > 0 for p in dumps), (dumps, log_of(job, 0)[-2000:])
        assert "flight recorder: dumped to" in log_of(job, 0)
    assert_nothing_left([job])
    gpu_watch.assert_free([job])
    print(f"NVML listed the ranks' pids while they ran: {seen}", flush=True)


def rank_log(job: JobView, rank: int) -> str:
    path = job.ranks[rank].log
    assert path is not None
    return path
