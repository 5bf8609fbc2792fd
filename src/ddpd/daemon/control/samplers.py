"""What a metrics scrape reads from the system: each live rank's resident memory and CPU time (psutil) and
each GPU's memory and utilisation (NVML, through `gpus`).

`sample` blocks (it reads /proc and asks the driver): run it in a worker thread. Its time is bounded:
ranks are read until `budget` seconds have passed (the rest are left out of that scrape and counted),
at most `MAX_RANKS` of them. A pid is read only while it is still a child of this daemon, so a pid that
was reused after its rank ended is never reported as the rank. NVML that is missing or fails gives no
GPU samples, and is not asked again for `NVML_RETRY` seconds.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import psutil

from ..gpu.gpus import GpuInfo, NvmlUnavailable, nvml_discover, visible

RANK_BUDGET = 1.0  # seconds one scrape may spend reading ranks
MAX_RANKS = 4096
NVML_RETRY = 60.0  # seconds before NVML is asked again after it failed

_nvml_down_until = 0.0
_nvml_state = threading.Lock()


@dataclass(frozen=True)
class RankTarget:
    """A live rank to read: its labels and pid."""

    job_id: str
    attempt: int
    rank: int
    pid: int


@dataclass(frozen=True)
class RankUsage:
    target: RankTarget
    rss: int  # bytes
    cpu_seconds: float  # user + system


@dataclass
class Usage:
    ranks: list[RankUsage] = field(default_factory=list)
    skipped: int = 0  # ranks left out: over the budget, gone, or not ours
    gpus: list[GpuInfo] = field(default_factory=list)


def read_rank(target: RankTarget, parent: int) -> RankUsage | None:
    """The rank's memory and CPU time, None when its pid is gone or no longer a child of `parent`."""
    try:
        proc = psutil.Process(target.pid)
        with proc.oneshot():
            if proc.ppid() != parent:
                return None
            mem = proc.memory_info()
            cpu = proc.cpu_times()
    except (psutil.Error, OSError):
        return None
    return RankUsage(target=target, rss=int(mem.rss), cpu_seconds=float(cpu.user + cpu.system))


def read_gpus(now: float) -> list[GpuInfo]:
    """The daemon's GPUs through NVML (those its CUDA_VISIBLE_DEVICES names); [] when NVML cannot answer."""
    global _nvml_down_until
    with _nvml_state:
        if now < _nvml_down_until:
            return []
    try:
        return visible(nvml_discover(), os.environ.get("CUDA_VISIBLE_DEVICES"))
    except NvmlUnavailable:
        with _nvml_state:
            _nvml_down_until = now + NVML_RETRY
        return []


def sample(targets: Sequence[RankTarget], budget: float = RANK_BUDGET, *, gpus: bool = True,
           clock: Callable[[], float] = time.monotonic) -> Usage:
    usage = Usage()
    deadline = clock() + budget
    parent = os.getpid()
    for i, target in enumerate(targets):
        if i >= MAX_RANKS or clock() > deadline:
            usage.skipped += len(targets) - i
            break
        read = read_rank(target, parent)
        if read is None:
            usage.skipped += 1
        else:
            usage.ranks.append(read)
    if gpus:
        usage.gpus = read_gpus(clock())
    return usage
