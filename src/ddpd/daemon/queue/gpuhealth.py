"""The quarantine of faulty GPUs: what the scheduler does with `gpu.health`'s faults.

A critical fault (an Xid of `gpu.health.CRITICAL_XIDS`, a double-bit ECC error, NVML failing on the
GPU for 30 s) quarantines each of the daemon's devices on that GPU: recorded in the state database
(`store.quarantine`, so it outlives a restart), kept off placement (`Resources.quarantined`), and
journalled as ``gpu.quarantined``. Every running job given such a device has its attempt failed
with a root cause naming the GPU and the fault ("GPU 3 (GPU-5f2e...): Xid 79, fell off the bus");
its runner then restarts it elsewhere, within its restart policy (`must_move`). Any other Xid
is journalled (``gpu.xid``) and nothing more. Only `release` (an admin's `ddpctl gpu release`)
lifts a quarantine: it is not the automatic draining of a GPU whose rank is dying.

The idle watch (`watch_idle`) samples every GPU's utilisation each `gpu_sample_interval` seconds
(`gpu.utilisation`, off the loop, bounded); a running job all of whose GPUs have stayed at 0% for
`gpu_idle_after` seconds of this attempt gets one ``job.gpu_idle`` warning (again only after its
GPUs were busy once more), and is cancelled with reason ``gpu_idle`` where `gpu_idle_cancel` says
so. A GPU shared by fractions is busy for every job on it.
"""

from __future__ import annotations

import time

import anyio
import structlog

from ...protocol import JobState
from ..config import Config
from ..gpu.gpus import GpuInfo
from ..gpu.health import GpuFault, watch_health
from ..gpu.utilisation import UtilisationLog, sample_async
from ..store import quarantine as qstore
from ..store.errors import NotFoundError, StorageError
from ..store.journal import Journal
from ..store.quarantine import Quarantined
from ..store.records import Job
from . import commands
from .live import LiveConfig
from .resources import Resources
from .runners import Runners

log = structlog.get_logger("ddpd")


def gpu_name(device: GpuInfo) -> str:
    """How a root cause names a device: "GPU 3 (GPU-5f2e...)"."""
    return f"GPU {device.label} ({device.uuid})" if device.uuid else f"GPU {device.label}"


def find_device(devices: list[GpuInfo], name: str) -> GpuInfo | None:
    """The device `name` names: its NVML index (``3``, ``3/mig1``), its UUID or a unique prefix of it."""
    name = name.strip()
    by_label = [d for d in devices if d.label == name]
    if by_label:
        return by_label[0] if len(by_label) == 1 else None
    hits = [d for d in devices if name and d.uuid and d.uuid.startswith(name)]
    return hits[0] if len(hits) == 1 else None


class GpuHealth:
    """The daemon's quarantine: loaded at start, fed by the GPU watch, released by an admin."""

    def __init__(self, journal: Journal, resources: Resources, runners: Runners, live: LiveConfig,
                 utilization: UtilisationLog | None = None) -> None:
        self.journal = journal
        self.live = live  # the daemon's current config (read at each sample: a reload changes the idle settings)
        self.utilization = UtilisationLog() if utilization is None else utilization
        self._first_seen: dict[tuple[str, int], float] = {}  # (job, attempt) -> its first sample running
        self._warned: set[tuple[str, int]] = set()
        self.resources = resources
        self.runners = runners  # the running jobs, told of a fault on their GPUs (commands.GpuFault)
        self.held: dict[str, Quarantined] = {}

    async def load(self) -> None:
        """The quarantines recorded before this start, for the devices this daemon schedules."""
        try:
            stored = await qstore.load(self.journal.db)
        except Exception:  # an unreadable table: the daemon still serves; the watch quarantines anew
            log.exception("gpu.quarantine_unreadable")
            return
        mine = {d.entry for d in self.resources.devices}
        self.held = {e: r for e, r in stored.items() if e in mine}
        self.resources.quarantined.update({e: r.reason for e, r in self.held.items()})
        for record in self.held.values():
            log.warning("gpu.still_quarantined", gpu=record.label, reason=record.reason)

    async def run(self) -> None:
        await watch_health(self.resources.devices, self.fault, self.note)

    async def fault(self, fault: GpuFault) -> None:
        """A fault from the watch; a bug in handling it is logged, never the end of the watch."""
        try:
            await self._fault(fault)
        except Exception:
            log.exception("gpu.fault_unhandled", gpu=fault.index, what=fault.what)

    async def watch_idle(self) -> None:
        """Sample the GPUs' utilisation and warn (or cancel) the jobs whose GPUs stay at 0%."""
        devices = [d for d in self.resources.devices if d.source == "nvml"]
        if not devices:
            return
        while True:
            cfg = self.live.current
            try:
                self.utilization.add(time.time(), await sample_async(devices))
                await self.check_idle(time.time(), cfg)
            except Exception:  # a bug here must not end the daemon: logged, sampled again next time
                log.exception("gpu.idle_watch_failed")
            await anyio.sleep(cfg.gpu_sample_interval)

    async def check_idle(self, now: float, cfg: Config) -> None:
        running = [j for j in self.runners.running_jobs() if j.gpus and j.state is JobState.RUNNING]
        live = {(j.id, j.attempt) for j in running}
        self._first_seen = {k: v for k, v in self._first_seen.items() if k in live}
        self._warned &= live
        for job in running:
            key = (job.id, job.attempt)
            first = self._first_seen.setdefault(key, now)
            since = [self.utilization.idle_since(e) for e in dict.fromkeys(job.gpus)]
            if any(s is None for s in since):
                self._warned.discard(key)  # busy again: a later idle spell is warned anew
                continue
            idle = now - max(first, *(s for s in since if s is not None))
            if cfg.gpu_idle_after is None or idle < cfg.gpu_idle_after or key in self._warned:
                continue
            self._warned.add(key)
            await self._idle(job, idle, cfg)

    async def _idle(self, job: Job, idle: float, cfg: Config) -> None:
        names = [gpu_name(d) for e in dict.fromkeys(job.gpus) if (d := self.resources.device(e)) is not None]
        await self.journal.event(job, "job.gpu_idle", gpus=names, seconds=round(idle, 1), after=cfg.gpu_idle_after,
                                 cancel=cfg.gpu_idle_cancel)
        if cfg.gpu_idle_cancel:
            why = f"gpu_idle: its GPUs were at 0% for {idle:.0f} s"
            await self.runners.send(job.id, commands.Cancel(why, force=False)).wait()

    async def note(self, notes: list[str]) -> None:
        await self.journal.event(None, "gpu.unwatched", notes=notes)

    async def _fault(self, fault: GpuFault) -> None:
        devices = [d for d in self.resources.devices if d.index == fault.index and d.source == "nvml"]
        kind = {"xid": "gpu.xid", "ecc": "gpu.ecc_error", "nvml": "gpu.nvml_failing"}[fault.kind]
        await self.journal.event(None, kind, gpu=fault.index, uuids=[d.uuid for d in devices], what=fault.what,
                                 xid=fault.xid, critical=fault.critical)
        if fault.critical:
            for device in devices:
                await self.quarantine(device, fault.what)

    async def quarantine(self, device: GpuInfo, what: str) -> None:
        """Hold `device` off placement (recorded) and fail the attempts of the jobs on it."""
        jobs = [j for j in self.runners.running_jobs() if device.entry in j.gpus]
        if device.entry not in self.held:
            holder = jobs[0].id if jobs else None
            try:
                record = await qstore.hold(self.journal.db, device.entry, gpu_name(device), what, holder)
            except StorageError as exc:  # held all the same, until this daemon stops
                log.error("gpu.quarantine_unrecorded", gpu=gpu_name(device), error=str(exc))
                record = Quarantined(device.entry, gpu_name(device), what, time.time(), holder)
            self.held[device.entry] = record
            self.resources.quarantined[device.entry] = what
            await self.journal.event(None, "gpu.quarantined", gpu=device.label, uuid=device.uuid, reason=what,
                                     jobs=[j.id for j in jobs])
        for job in jobs:
            self.runners.send(job.id, commands.GpuFault(f"{gpu_name(device)}: {what}"))

    def fault_on(self, gpus: list[str]) -> str | None:
        """The root cause of a job given `gpus` one of which is quarantined ("GPU 3 (...): Xid 79, ..."), or None."""
        for entry in dict.fromkeys(gpus):
            record = self.held.get(entry)
            device = self.resources.device(entry)
            if record is not None and device is not None:
                return f"{gpu_name(device)}: {record.reason}"
        return None

    def must_move(self, gpus: list[str]) -> bool:
        """Whether a job given `gpus` holds a quarantined one (its restart must be placed again)."""
        return any(e in self.resources.quarantined for e in gpus)

    async def release(self, name: str, uid: int) -> Quarantined:
        """Lift the quarantine of the device `name` names (NotFoundError: none, or not quarantined); the
        caller wakes the queue (a released GPU may let queued jobs start)."""
        device = find_device(self.resources.devices, name)
        if device is None:
            raise NotFoundError(f"no GPU {name!r} on this daemon (its NVML index or UUID)")
        record = self.held.get(device.entry)
        if record is None:
            raise NotFoundError(f"{gpu_name(device)} is not quarantined")
        await qstore.release(self.journal.db, device.entry)
        del self.held[device.entry]
        self.resources.quarantined.pop(device.entry, None)
        await self.journal.event(None, "gpu.released", gpu=device.label, uuid=device.uuid, reason=record.reason,
                                 by_uid=uid)
        return record
