"""What the machine lends to jobs: GPU devices (by UUID, in shares) and CPU slots; a job takes all it needs or waits.

Each device is counted in thousandths (`GPU_SHARE`): a rank with k whole GPUs takes k devices
wholly free; a rank with a fraction f takes f of one device, packed onto the fullest device
that still has room (so fractions fill one GPU before they spread to the next). `take` returns
the job's devices in rank order (`gpu.layout`), entries repeated where ranks share a device.

GPUs of an ended job whose ranks may still hold them (a rank reported unkillable, or NVML still
listing a rank's process) are *draining*: `hold` keeps them off the free list under the job's id
until `give_back`. A *quarantined* device (gpu.health: an Xid, an ECC error) is never placed on,
free or not, until an admin releases it.
"""

from __future__ import annotations

import math

from ...protocol import JobSpec
from ...protocol.spec import GPU_SHARE, rank_gpus
from ..gpu.gpus import GpuInfo, unnamed


class Resources:
    """GPU devices (by `GpuInfo.entry`) and CPU slots; a job takes all it needs or waits."""

    def __init__(self, gpus: list[GpuInfo] | int, cpu_slots: int) -> None:
        self.devices = unnamed(gpus) if isinstance(gpus, int) else list(gpus)
        self.free_share = {d.entry: GPU_SHARE for d in self.devices}  # thousandths not held
        self.draining: dict[str, list[str]] = {}  # job id -> the entries its dying ranks may hold
        self.quarantined: dict[str, str] = {}  # entry -> why (queue.gpuhealth keeps it)
        self.total_cpu = cpu_slots
        self.free_cpu = cpu_slots

    @property
    def total_gpus(self) -> int:
        return len(self.devices)

    @property
    def free_gpus(self) -> list[str]:
        """The devices no job holds any share of."""
        return [e for e, free in self.free_share.items() if free == GPU_SHARE and e not in self.quarantined]

    def device(self, entry: str) -> GpuInfo | None:
        return next((d for d in self.devices if d.entry == entry), None)

    @staticmethod
    def need(spec: JobSpec) -> tuple[float, int]:
        """(GPUs, CPU slots) a job holds while it runs: a GPU job's ranks wait on their devices."""
        k, share = rank_gpus(spec.gpus_per_rank)
        gpus = spec.nproc * k * share / GPU_SHARE
        return gpus, (0 if gpus else spec.nproc)

    def can_ever_fit(self, spec: JobSpec) -> str | None:
        k, share = rank_gpus(spec.gpus_per_rank)
        devices = spec.nproc * k if share in (0, GPU_SHARE) else math.ceil(spec.nproc / (GPU_SHARE // share))
        if devices > self.total_gpus:
            return (f"needs {devices} GPUs ({spec.nproc} ranks x {spec.gpus_per_rank:g}) but the daemon has "
                    f"{self.total_gpus}")
        cpu = self.need(spec)[1]
        if cpu > self.total_cpu and not spec.oversubscribe:
            return (f"needs {cpu} CPU slots ({spec.nproc} ranks) but the daemon has {self.total_cpu} (its "
                    "cpu_slots setting); --oversubscribe runs it anyway, its ranks sharing cores")
        return None

    def shortfall(self, spec: JobSpec) -> str:
        """What a job that does not fit now waits for: "needs 2 CPU slots, 1 of 2 free"."""
        gpus, _ = self.need(spec)
        if gpus:
            held = f" ({len(self.quarantined)} quarantined)" if self.quarantined else ""
            return f"needs {gpus:g} GPUs, {len(self.free_gpus)} of {self.total_gpus} free{held}"
        return f"needs {self.cpu_of(spec)} CPU slots, {max(0, self.free_cpu)} of {self.total_cpu} free"

    def cpu_of(self, spec: JobSpec) -> int:
        """CPU slots the job holds: one per rank, all the daemon has for an oversubscribed job."""
        cpu = self.need(spec)[1]
        return min(cpu, self.total_cpu) if spec.oversubscribe else cpu

    def _place(self, spec: JobSpec) -> list[str] | None:
        """Each rank's devices, in rank order, on a copy of the free shares; None where they do not fit."""
        k, share = rank_gpus(spec.gpus_per_rank)
        free = {e: f for e, f in self.free_share.items() if e not in self.quarantined}
        placed: list[str] = []
        for _ in range(spec.nproc):
            fits = sorted((e for e, f in free.items() if f >= share), key=lambda e: free[e] if share < GPU_SHARE else 0)
            if len(fits) < k:
                return None
            for entry in fits[:k]:
                free[entry] -= share
                placed.append(entry)
        return placed

    def take(self, spec: JobSpec) -> list[str] | None:
        """The devices given to the job, rank by rank (empty for a CPU job), or None when it must wait."""
        cpu = self.cpu_of(spec)
        if cpu > self.free_cpu:
            return None
        placed = self._place(spec)
        if placed is None:
            return None
        _, share = rank_gpus(spec.gpus_per_rank)
        for entry in placed:
            self.free_share[entry] -= share
        self.free_cpu -= cpu
        return placed

    def busy_cpu(self) -> int:
        """CPU slots held by running jobs (ranks that occupy a CPU; GPU jobs mostly wait on their devices)."""
        return self.total_cpu - self.free_cpu

    def hold(self, job_id: str, gpus: list[str]) -> None:
        """The job's devices are draining: still held, shown under the job's id until `give_back`."""
        self.draining[job_id] = list(dict.fromkeys(gpus))

    def give_back(self, spec: JobSpec, gpus: list[str], job_id: str | None = None) -> None:
        _, share = rank_gpus(spec.gpus_per_rank)
        for entry in gpus:
            if entry in self.free_share:
                self.free_share[entry] = min(GPU_SHARE, self.free_share[entry] + share)
        if job_id is not None:
            self.draining.pop(job_id, None)
        self.free_cpu += self.cpu_of(spec)

    def held_share(self, entry: str) -> float:
        """The fraction of a device jobs hold (0 to 1)."""
        return 1 - self.free_share.get(entry, GPU_SHARE) / GPU_SHARE

    def resize_cpu(self, cpu_slots: int) -> None:
        """A reload changed cpu_slots: free slots may go negative until running jobs give theirs back."""
        self.free_cpu += cpu_slots - self.total_cpu
        self.total_cpu = cpu_slots
