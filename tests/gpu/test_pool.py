"""A pooled rank honours the CUDA_VISIBLE_DEVICES of its assignment (it started before knowing it).

The interpreter pool's (``pool_fork_server = false``: the rank is the very interpreter that was
ready); forked ranks on CUDA are test_forkserver.py's."""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from ddpd.protocol import JobState

from ..conftest import DaemonProc, running_daemon
from ..integration.test_pool import pool_full, pool_pids_seen
from .conftest import GpuWatch, log_of

pytestmark = pytest.mark.anyio


@pytest.fixture
async def gpu_pool_daemon(short_tmp: Path) -> AsyncIterator[DaemonProc]:
    config = short_tmp / "ddpd.toml"
    config.write_text("pool_fork_server = false\n")
    async with running_daemon(short_tmp, "--config", str(config), "--pool-size", "2", "--cpu-slots", "4") as d:
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


def driver_files(pid: int) -> list[str]:
    """The CUDA driver's device files a process holds open: cuInit opens /dev/nvidiactl (and a context
    /dev/nvidiaN), so none open means no driver initialisation and no context."""
    fds = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed while listed
            continue
        if target.startswith("/dev/nvidia"):
            fds.append(f"fd {fd.name} -> {target}")
    return fds


def libcuda_mapped(pid: int) -> bool:
    return any("libcuda.so" in line for line in Path(f"/proc/{pid}/maps").read_text().splitlines())


_COLD_IMPORTS = """
from pathlib import Path
from ddpd.worker.bootstrap import pool_imports
pool_imports()
print(any("libcuda.so" in line for line in Path("/proc/self/maps").read_text().splitlines()))
"""


async def test_a_pooled_interpreter_has_not_touched_the_driver_before_its_assignment(
        gpu_pool_daemon: DaemonProc) -> None:
    """Natively, not only through torch's Python flag: no /dev/nvidia* open (no cuInit, no context). A
    CUDA context made before the assignment would pin the rank to the wrong GPU (and hold memory).
    Loading libcuda.so is not initialising it: on the H200 machine (torch 2.11, CUDA 13 build) a plain
    `import torch` maps it already (the test prints whether a cold interpreter importing the same modules
    does too), and the driver reads CUDA_VISIBLE_DEVICES at cuInit, after the assignment."""
    d = gpu_pool_daemon
    pooled = await pool_full(d)
    for pid in pooled:
        assert driver_files(pid) == [], f"pooled interpreter {pid} has initialised the CUDA driver"
    with anyio.fail_after(120):
        cold = await anyio.run_process([sys.executable, "-c", _COLD_IMPORTS], check=False)
    assert cold.returncode == 0, cold.stderr.decode()
    print(f"libcuda.so mapped: pooled {[libcuda_mapped(pid) for pid in pooled]}, "
          f"a cold interpreter after the same imports {cold.stdout.decode().split()[-1]}")
    job = await d.run(d.spec(task="tests.gpu.tasks:report_device", nproc=1, steps=5, device="cuda"))
    assert job.state == JobState.SUCCEEDED, job.root_cause
    assert job.ranks[0].pid in pooled
