"""Draining: the GPUs of an ended job go to the next job only once nothing of it can still hold them.

A rank reported unkillable (stuck in the driver's teardown, say) still holds its GPU memory, and
the driver may list a process on a GPU for a moment after it exited. So a GPU job's devices are
released when (1) none of its rank processes is left (a zombie has closed its device files: it
counts as gone) and (2) NVML lists none of their pids on those devices (where NVML answers).
`wait_drained` waits for both: for (1) on each process's pidfd, for (2) by asking NVML every
`DRAIN_POLL` seconds (NVML has no event for it); it reports once when it has to wait.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable

import anyio
import anyio.to_thread

from ..contain import procs
from ..store.journal import Journal
from ..store.records import Job
from .gpus import GpuInfo, NvmlUnavailable, processes

DRAIN_POLL = 1.0  # seconds between looks while a job's GPUs drain
LOOK_TIMEOUT = 10.0  # seconds one look may take (NVML answering slowly: the GPUs stay draining)

Report = Callable[[list[int], list[int]], Awaitable[None]]  # (pids alive, pids NVML lists)


def alive(pids: list[int], job_id: str) -> list[int]:
    """The pids that are still processes of the job, zombies not counted: a cold rank carries the
    job's DDPD_JOB_ID in /proc/PID/environ; a pooled one (started before the job, so its environ
    does not say) is still this daemon's child."""
    marker = f"DDPD_JOB_ID={job_id}".encode()
    out = []
    for pid in pids:
        info = procs.proc_info(pid)
        if info is None or info.state == "Z":
            continue
        if info.ppid == os.getpid() or procs.proc_environ_has(pid, marker):
            out.append(pid)
    return out


def listed(pids: list[int], devices: list[GpuInfo]) -> list[int]:
    """The pids NVML lists on any of the devices ([] where NVML cannot answer for a device)."""
    found: set[int] = set()
    for gpu in devices:
        try:
            found |= {p.pid for p in processes(gpu)} & set(pids)
        except NvmlUnavailable:
            continue
    return sorted(found)


def look(job_id: str, pids: list[int], devices: list[GpuInfo]) -> tuple[list[int], list[int]]:
    left = alive(pids, job_id)
    return left, listed(pids, devices) if devices else []


async def wait_drained(job_id: str, pids: list[int], devices: list[GpuInfo], report: Report) -> None:
    """Return once none of `pids` is a live process of the job and NVML lists none on `devices`;
    `report(alive, listed)` is awaited once, the first time either is not empty."""
    reported = False
    while True:
        try:
            with anyio.fail_after(LOOK_TIMEOUT):
                left, on_gpu = await anyio.to_thread.run_sync(look, job_id, pids, devices, abandon_on_cancel=True)
        except TimeoutError:
            left, on_gpu = [], list(pids)
        if not left and not on_gpu:
            return
        if not reported:
            reported = True
            await report(left, on_gpu)
        with anyio.move_on_after(DRAIN_POLL):
            for pid in left:  # woken at once when the last of them exits
                await procs.wait_gone(pid)
            if not left:
                await anyio.sleep(DRAIN_POLL)


async def drain_job(job: Job, devices: list[GpuInfo], journal: Journal) -> None:
    """Wait until the ended job's ranks can no longer hold `devices`; journal ``job.gpus_draining``
    when it has to wait, and ``job.gpus_released`` when the wait ends."""
    pids = [r.pid for r in job.ranks if r.pid is not None]
    names = [f"{d.label} {d.uuid}".strip() for d in devices]
    waited = False

    async def report(left: list[int], on_gpu: list[int]) -> None:
        nonlocal waited
        waited = True
        await journal.event(job, "job.gpus_draining", gpus=names, alive=left, listed=on_gpu)

    await wait_drained(job.id, pids, devices, report)
    if waited:
        await journal.event(job, "job.gpus_released", gpus=names)
