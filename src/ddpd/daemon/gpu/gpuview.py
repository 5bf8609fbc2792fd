"""What `ddpctl daemon` and `status` show of the GPUs: NVML's figures mapped onto jobs and ranks.

Every view names a device as the scheduler does: its NVML index (and MIG index) with its UUID.

- `daemon_gpus`: each of the daemon's devices (the scheduler's `Devices`) with NVML's current
  memory and utilisation, the share jobs hold, the jobs holding it (the running jobs the
  scheduler gave it to, and any job with a rank's process on it), and the ended jobs whose ranks
  may still hold it (draining); other processes on it are counted, never named.
- `with_rank_gpus`: each rank's devices (`layout.own_entries`: what the rank uses, also in a
  script's ``DDPD_CUDA_DEVICES``), its share of a shared GPU, plus any other device NVML shows its
  process on, and the memory its own process holds on each.

The mapping (`holders`, `rank_memory`, `gpu_views`) is pure; `daemon_gpus` and `with_rank_gpus`
ask NVML off the loop, bounded, and degrade to no figures where NVML cannot answer (never the
torch fallback: that takes seconds, not a status request's milliseconds).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol, TypeVar

import anyio
import anyio.to_thread
import msgspec

from ...protocol.control import GpuView, JobView, RankGpu
from ...protocol.spec import GPU_SHARE, rank_gpus
from ..store.records import Job
from .gpus import GpuInfo, GpuProcess, NvmlUnavailable, nvml_discover, processes, visible
from .layout import own_entries
from .utilisation import UtilisationLog

NVML_WAIT = 5.0  # seconds a view waits for NVML before it is shown without GPU figures
T = TypeVar("T")
Processes = Mapping[str, list[GpuProcess]]  # device entry -> the processes on it


class Devices(Protocol):
    """The scheduler's devices (queue.resources.Resources)."""

    devices: list[GpuInfo]
    draining: dict[str, list[str]]
    quarantined: dict[str, str]

    def held_share(self, entry: str) -> float: ...


def rank_memory(assigned: list[GpuInfo], pid: int | None, procs: Processes, devices: list[GpuInfo],
                share: float | None = None) -> list[RankGpu]:
    """The rank's devices and the memory its process holds on each (None where NVML does not list it);
    a device it was not given but holds memory on is listed too (a script may pick any device it sees)."""
    out = []
    given = {g.entry for g in assigned}
    for gpu in [*assigned, *(d for d in devices if d.entry not in given)]:
        used = [p.memory_used for p in procs.get(gpu.entry, []) if pid is not None and p.pid == pid]
        if gpu.entry not in given and not used:
            continue
        known = [u for u in used if u is not None]
        out.append(RankGpu(index=gpu.index, memory_used=sum(known) if known else None, uuid=gpu.uuid, mig=gpu.mig,
                           share=share if gpu.entry in given else None))
    return out


def holders(entry: str, running: Iterable[Job], procs: Processes) -> tuple[list[str], int]:
    """The jobs holding device `entry` (given it, or a rank's process on it), and how many other
    processes are on it."""
    rank_pids: dict[int, str] = {}
    jobs: list[str] = []
    for job in running:
        if entry in job.gpus:
            jobs.append(job.id)
        for r in job.ranks:
            if r.pid is not None:
                rank_pids[r.pid] = job.id
    others = 0
    for p in procs.get(entry, []):
        holder = rank_pids.get(p.pid)
        if holder is None:
            others += 1
        elif holder not in jobs:
            jobs.append(holder)
    return jobs, others


def gpu_views(infos: list[GpuInfo], running: list[Job], procs: Processes, held: Devices | None = None) -> list[GpuView]:
    views = []
    for g in infos:
        jobs, others = holders(g.entry, running, procs)
        draining = [] if held is None else [j for j, entries in held.draining.items() if g.entry in entries]
        views.append(GpuView(index=g.index, name=g.name, memory_total=g.memory_total, memory_used=g.memory_used,
                             utilization=g.utilization, jobs=jobs, other_processes=others, uuid=g.uuid, mig=g.mig,
                             held=0.0 if held is None else round(held.held_share(g.entry), 3), draining=draining,
                             quarantined=None if held is None else held.quarantined.get(g.entry)))
    return views


def current(devices: list[GpuInfo]) -> list[GpuInfo]:
    """The devices with NVML's figures of now (by UUID; as they were where NVML does not list one).
    Without `devices` (a daemon that did not say): those NVML lists under the daemon's own
    ``CUDA_VISIBLE_DEVICES``. Raises NvmlUnavailable."""
    found = nvml_discover()
    if not devices:
        return visible(found, os.environ.get("CUDA_VISIBLE_DEVICES"))
    fresh = {g.uuid: g for g in found if g.uuid}
    return [fresh.get(d.uuid, d) if d.uuid else d for d in devices]


def _all_processes(devices: Iterable[GpuInfo]) -> dict[str, list[GpuProcess]]:
    """Each device's processes; a device NVML cannot answer for has none listed (the others still do)."""
    out: dict[str, list[GpuProcess]] = {}
    for gpu in devices:
        try:
            out[gpu.entry] = processes(gpu)
        except NvmlUnavailable:
            out[gpu.entry] = []
    return out


async def _nvml(call: Callable[[], T]) -> T:
    with anyio.fail_after(NVML_WAIT):
        return await anyio.to_thread.run_sync(call, abandon_on_cancel=True)


async def daemon_gpus(running: list[Job], held: Devices | None = None) -> tuple[list[GpuView], str | None]:
    """Every device of the daemon with its holders, or (the devices without NVML's figures, why not)."""
    devices = [] if held is None else held.devices
    try:
        infos = await _nvml(lambda: current(devices))
        procs = await _nvml(lambda: _all_processes(infos))
    except NvmlUnavailable as exc:
        return gpu_views(devices, running, {}, held), str(exc)
    except TimeoutError:
        return gpu_views(devices, running, {}, held), f"NVML did not answer within {NVML_WAIT:g} s"
    return gpu_views(infos, running, procs, held), None


def _device_of(entry: str, devices: list[GpuInfo]) -> GpuInfo:
    found = next((d for d in devices if d.entry == entry), None)
    if found is not None:
        return found
    index = int(entry) if entry.isdigit() else -1
    return GpuInfo(index=index, name="GPU", uuid="" if entry.isdigit() else entry, memory_total=None,
                   memory_used=None, utilization=None, source="config")


def with_utilisation(gpus: list[RankGpu], history: UtilisationLog | None, now: float) -> list[RankGpu]:
    """Each device's utilisation samples of the last minutes (`history`, the idle watch's)."""
    if history is None:
        return gpus
    return [msgspec.structs.replace(g, utilization=history.recent(g.uuid or str(g.index), now)) for g in gpus]


async def with_rank_gpus(view: JobView, job: Job, held: Devices | None = None,
                         history: UtilisationLog | None = None) -> JobView:
    """`view` with each rank's devices, their memory where NVML answers and their recent utilisation
    (a job without GPUs: as is)."""
    if not job.gpus or not view.ranks:
        return view
    devices = [] if held is None else held.devices
    _, share = rank_gpus(job.spec.gpus_per_rank)
    fraction = share / GPU_SHARE if 0 < share < GPU_SHARE else None
    procs: Processes = {}
    if not job.state.final:
        try:
            procs = await _nvml(lambda: _all_processes([*devices] or [_device_of(e, []) for e in set(job.gpus)]))
        except (NvmlUnavailable, TimeoutError):
            procs = {}
    now = time.time()
    ranks = [msgspec.structs.replace(r, gpus=with_utilisation(rank_memory(
        [_device_of(e, devices) for e in own_entries(job.gpus, job.spec, r.rank)], r.pid, procs, devices, fraction),
        None if job.state.final else history, now)) for r in view.ranks]
    return msgspec.structs.replace(view, ranks=ranks)
