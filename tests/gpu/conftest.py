"""The GPU tier: real daemon, real workers, real CUDA. Every test here is skipped, with the reason,
where torch finds no CUDA device; `scripts/gpu-check` runs the tier where one is.

Helpers: `gpu_count`, the `gpu_daemon` fixture, and `GpuWatch`, which proves that nothing of a
job is left on any GPU (NVML's process list, with a memory check where NVML cannot see the
ranks' pids, as in a container's pid namespace).
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from ddpd.daemon.gpu import gpus
from ddpd.protocol.control import JobView

from ..conftest import DaemonProc, running_daemon

MEMORY_SLACK = 256 << 20  # bytes a GPU's used memory may differ from before the job


@functools.cache
def cuda_reason() -> str | None:
    """Why the GPU tier cannot run here, or None."""
    try:
        import torch
    except ImportError as exc:
        return f"torch is not importable: {exc}"
    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is built without CUDA"
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False: no CUDA device or driver here"
    return None


@functools.cache
def gpu_count() -> int:
    import torch

    return int(torch.cuda.device_count())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = cuda_reason()
    if reason is None:
        return
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.skip(reason=f"GPU test: {reason}"))


def needs_gpus(n: int) -> pytest.MarkDecorator:
    """Skip (with the reason) unless at least `n` GPUs exist; decided at run time, CUDA checked first."""
    return pytest.mark.skipif(cuda_reason() is None and gpu_count() < n, reason=f"needs {n} GPUs")


def log_of(job: JobView, rank: int) -> str:
    """The text of a rank's logs: its stdout, then its stderr (``rank-<r>.err`` beside it)."""
    path = job.ranks[rank].log
    assert path is not None, job.ranks[rank]
    err = Path(path.removesuffix(".log") + ".err")
    return Path(path).read_text(errors="replace") + (err.read_text(errors="replace") if err.exists() else "")


@pytest.fixture
async def gpu_daemon(short_tmp: Path) -> AsyncIterator[DaemonProc]:
    async with running_daemon(short_tmp, "--cpu-slots", "4") as d:
        yield d


class GpuWatch:
    """Each GPU's processes and memory before a job; `assert_free` proves the job left nothing there."""

    def __init__(self) -> None:
        self.before = {g.entry: g for g in gpus.nvml_discover()}
        self.seen_rank_pids = False

    async def saw_ranks(self, job: JobView) -> bool:
        """While the job runs: does NVML list any of its rank pids on a GPU? (False in a pid namespace.)"""
        pids = {r.pid for r in job.ranks if r.pid is not None}
        for gpu in self.before.values():
            if pids & {p.pid for p in await gpus.processes_async(gpu)}:
                self.seen_rank_pids = True
        return self.seen_rank_pids

    def assert_free(self, jobs: list[JobView]) -> None:
        pids = {r.pid for j in jobs for r in j.ranks if r.pid is not None}
        for info in gpus.nvml_discover():
            left = pids & {p.pid for p in gpus.processes(info)}
            assert not left, f"GPU {info.label} still has rank processes {sorted(left)}"
            before = self.before[info.entry].memory_used
            if info.memory_used is not None and before is not None:
                grew = info.memory_used - before
                assert grew < MEMORY_SLACK, f"GPU {info.label} holds {grew >> 20} MiB more than before the job"


@pytest.fixture
def gpu_watch() -> GpuWatch:
    return GpuWatch()
