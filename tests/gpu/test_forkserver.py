"""Forked ranks on CUDA (``pool_fork_server = true``): a rank forked by its key's server initialises
CUDA and NCCL as a cold rank does, and the server itself never opens the driver before, while or
after it forks them (the rest of the fork server: tests/integration/test_forkserver.py)."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from ddpd.protocol import JobState
from ddpd.protocol.control import JobView

from ..conftest import REPO, DaemonProc, assert_nothing_left, running_daemon
from ..integration.test_forkserver import SERVER_TIMEOUT, server_config
from .conftest import GpuWatch, gpu_count, log_of
from .test_pool import driver_files, libcuda_mapped

pytestmark = pytest.mark.anyio


@pytest.fixture
async def fork_gpu_daemon(short_tmp: Path) -> AsyncIterator[tuple[DaemonProc, int]]:
    async with running_daemon(short_tmp, "--config", str(server_config(short_tmp)), "--pool-size", "2",
                              "--cpu-slots", "4") as d:
        ready = await d.wait_log(lambda e: e.get("event") == "pool.worker_ready", SERVER_TIMEOUT)
        yield d, int(ready["pid"])


def forked_by(d: DaemonProc, job: JobView, server: int) -> bool:
    forked = {int(e["pid"]): int(e["server"]) for e in d.logs if e.get("event") == "pool.forked"}
    return all(forked.get(r.pid or 0) == server for r in job.ranks)


async def test_forked_ranks_run_cuda_and_nccl_and_the_server_never_opens_the_driver(
        fork_gpu_daemon: tuple[DaemonProc, int], gpu_watch: GpuWatch) -> None:
    d, server = fork_gpu_daemon
    assert driver_files(server) == [], "the fork server initialised the CUDA driver"
    job = await d.run(d.spec(task="tests.gpu.tasks:report_device", nproc=1, steps=50, device="cuda",
                             backend="nccl", options={"require_cuda": True}))
    assert job.state == JobState.SUCCEEDED, job.root_cause
    assert forked_by(d, job, server), "the rank was not forked by the server"
    assert "DEVICE cuda:0 count=1" in log_of(job, 0)
    jobs = [job]
    nproc = min(2, gpu_count())  # NCCL puts one rank on one GPU
    job = await d.run(d.spec(script=[str(REPO / "tests/gpu/nccl_script.py")], nproc=nproc, gpus_per_rank=1))
    assert job.state == JobState.SUCCEEDED, job.root_cause
    assert forked_by(d, job, server)
    for r in range(nproc):
        found = re.search(r"NCCL done rank=(\d) device=(\d) sum=(\S+)", log_of(job, r))
        assert found and float(found.group(3)) == nproc * (nproc + 1) / 2, log_of(job, r)[-2000:]
    jobs.append(job)
    assert driver_files(server) == [], "the fork server opened the CUDA driver while it forked ranks"
    print(f"libcuda.so mapped by the fork server: {libcuda_mapped(server)}")
    assert_nothing_left(jobs)
    gpu_watch.assert_free(jobs)
