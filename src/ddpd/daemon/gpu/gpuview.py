"""What `ddpctl daemon` and `status` show of the GPUs: NVML's figures mapped onto jobs and ranks.

- `daemon_gpus`: each GPU's memory and utilisation (`gpus.nvml_discover`) and the jobs holding
  it: the running jobs the scheduler gave it to, and any job with a rank's process on it
  (`gpus.processes`); other processes on it are counted, never named (they may be anyone's).
- `rank_gpus`: each rank's GPUs (the job's GPUs in the layout `launch` gives them, rank r's are
  ``gpus[r*k : r*k+k]`` with k = gpus_per_rank, plus any other GPU NVML shows its process on)
  and the memory its own process holds on each.

The mapping (`holders`, `rank_layout`, `rank_memory`) is pure; `daemon_gpus` and
`with_rank_gpus` ask NVML off the loop, bounded, and degrade to no figures where NVML cannot
answer (never the torch fallback: that takes seconds, not a status request's milliseconds).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TypeVar

import anyio
import anyio.to_thread
import msgspec

from ...protocol.control import GpuView, JobView, RankGpu
from ..store.records import Job
from .gpus import GpuInfo, GpuProcess, NvmlUnavailable, nvml_discover, processes

NVML_WAIT = 5.0  # seconds a view waits for NVML before it is shown without GPU figures
T = TypeVar("T")
Processes = Mapping[int, list[GpuProcess]]  # GPU index -> the processes on it


def rank_layout(gpus: list[int], nproc: int, per_rank: int) -> dict[int, list[int]]:
    """Rank -> the GPU indices it was given (what its CUDA_VISIBLE_DEVICES starts with)."""
    if not gpus or per_rank <= 0:
        return {r: [] for r in range(nproc)}
    return {r: gpus[r * per_rank:(r + 1) * per_rank] for r in range(nproc)}


def rank_memory(assigned: list[int], pid: int | None, procs: Processes) -> list[RankGpu]:
    """The rank's GPUs and the memory its process holds on each (None where NVML does not list it);
    a GPU it was not given but holds memory on is listed too (a script may pick any device it sees)."""
    out = []
    for index in [*assigned, *sorted(i for i in procs if i not in assigned)]:
        used = [p.memory_used for p in procs.get(index, []) if pid is not None and p.pid == pid]
        if index not in assigned and not used:
            continue
        known = [u for u in used if u is not None]
        out.append(RankGpu(index=index, memory_used=sum(known) if known else None))
    return out


def holders(index: int, running: Iterable[Job], procs: Processes) -> tuple[list[str], int]:
    """The jobs holding GPU `index` (given it, or a rank's process on it), and how many other
    processes are on it."""
    rank_pids: dict[int, str] = {}
    jobs: list[str] = []
    for job in running:
        if index in job.gpus:
            jobs.append(job.id)
        for r in job.ranks:
            if r.pid is not None:
                rank_pids[r.pid] = job.id
    others = 0
    for p in procs.get(index, []):
        holder = rank_pids.get(p.pid)
        if holder is None:
            others += 1
        elif holder not in jobs:
            jobs.append(holder)
    return jobs, others


def gpu_views(infos: list[GpuInfo], running: list[Job], procs: Processes) -> list[GpuView]:
    views = []
    for g in infos:
        jobs, others = holders(g.index, running, procs)
        views.append(GpuView(index=g.index, name=g.name, memory_total=g.memory_total, memory_used=g.memory_used,
                             utilization=g.utilization, jobs=jobs, other_processes=others))
    return views


def _all_processes(indices: Iterable[int]) -> dict[int, list[GpuProcess]]:
    return {i: processes(i) for i in indices}


async def _nvml(call: Callable[[], T]) -> T:
    with anyio.fail_after(NVML_WAIT):
        return await anyio.to_thread.run_sync(call, abandon_on_cancel=True)


async def daemon_gpus(running: list[Job]) -> tuple[list[GpuView], str | None]:
    """Every GPU NVML sees with its holders, or ([], why not)."""
    try:
        infos = await _nvml(nvml_discover)
        procs = await _nvml(lambda: _all_processes(g.index for g in infos))
    except NvmlUnavailable as exc:
        return [], str(exc)
    except TimeoutError:
        return [], f"NVML did not answer within {NVML_WAIT:g} s"
    return gpu_views(infos, running, procs), None


async def with_rank_gpus(view: JobView, job: Job) -> JobView:
    """`view` with each rank's GPUs, and their memory where NVML answers (a job without GPUs: as is)."""
    if not job.gpus or not view.ranks:
        return view
    layout = rank_layout(job.gpus, job.spec.nproc, job.spec.gpus_per_rank)
    procs: Processes = {}
    if not job.state.final:
        try:
            procs = await _nvml(lambda: _all_processes(job.gpus))
        except (NvmlUnavailable, TimeoutError):
            procs = {}
    ranks = [msgspec.structs.replace(r, gpus=rank_memory(layout.get(r.rank, []), r.pid, procs)) for r in view.ranks]
    return msgspec.structs.replace(view, ranks=ranks)
