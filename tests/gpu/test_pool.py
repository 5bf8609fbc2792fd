"""A pooled rank honours the CUDA_VISIBLE_DEVICES of its assignment (it started before knowing it)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from ddpd.protocol import JobState

from ..conftest import DaemonProc, running_daemon
from ..integration.test_pool import pool_full, pool_pids_seen
from .conftest import GpuWatch, log_of

pytestmark = pytest.mark.anyio


@pytest.fixture
async def gpu_pool_daemon(short_tmp: Path) -> AsyncIterator[DaemonProc]:
    async with running_daemon(short_tmp, "--pool-size", "2", "--cpu-slots", "4") as d:
        yield d


async def test_pooled_rank_sees_no_gpu_then_one(gpu_pool_daemon: DaemonProc, gpu_watch: GpuWatch) -> None:
    d = gpu_pool_daemon
    jobs = []
    for device, expected in (("cpu", "DEVICE cpu count=0 visible=''"), ("cuda", "DEVICE cuda:0 count=1")):
        pooled = await pool_full(d)
        job = await d.run(d.spec(task="tests.gpu.tasks:report_device", nproc=1, steps=5, device=device))
        assert job.state == JobState.SUCCEEDED, job.root_cause
        assert job.ranks[0].pid in pooled, "the rank did not run on a pooled interpreter"
        log = log_of(job, 0)
        assert expected in log, log[-2000:]
        jobs.append(job)
    assert pool_pids_seen(d)
    gpu_watch.assert_free(jobs)


def native_cuda(pid: int) -> list[str]:
    """What of the CUDA driver a process has loaded or opened: libcuda mappings, /dev/nvidia* descriptors."""
    maps = [line.split()[-1] for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if "libcuda.so" in line]
    fds = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed while listed
            continue
        if target.startswith("/dev/nvidia"):
            fds.append(f"fd {fd.name} -> {target}")
    return sorted(set(maps)) + fds


async def test_a_pooled_interpreter_has_not_touched_the_driver_before_its_assignment(
        gpu_pool_daemon: DaemonProc) -> None:
    """Natively, not only through torch's Python flag: no libcuda.so mapped, no /dev/nvidia* open. A
    CUDA context made before the assignment would pin the rank to the wrong GPU (and hold memory)."""
    d = gpu_pool_daemon
    pooled = await pool_full(d)
    for pid in pooled:
        assert native_cuda(pid) == [], f"pooled interpreter {pid} has touched the CUDA driver"
    job = await d.run(d.spec(task="tests.gpu.tasks:report_device", nproc=1, steps=5, device="cuda"))
    assert job.state == JobState.SUCCEEDED, job.root_cause
    assert job.ranks[0].pid in pooled
