"""What the machine lends to jobs: GPUs (by index) and CPU slots; a job takes all it needs or waits."""

from __future__ import annotations

from ...protocol import JobSpec


class Resources:
    """GPUs (by index) and CPU slots; a job takes all it needs or waits."""

    def __init__(self, gpus: int, cpu_slots: int) -> None:
        self.total_gpus = gpus
        self.free_gpus = list(range(gpus))
        self.total_cpu = cpu_slots
        self.free_cpu = cpu_slots

    @staticmethod
    def need(spec: JobSpec) -> tuple[int, int]:
        """(GPUs, CPU slots) a job holds while it runs: a GPU job's ranks wait on their devices."""
        gpus = spec.nproc * spec.gpus_per_rank
        return gpus, (0 if gpus else spec.nproc)

    def can_ever_fit(self, spec: JobSpec) -> str | None:
        gpus, cpu = self.need(spec)
        if gpus > self.total_gpus:
            return (f"needs {gpus} GPUs ({spec.nproc} ranks x {spec.gpus_per_rank}) but the daemon has "
                    f"{self.total_gpus}")
        if cpu > self.total_cpu:
            return f"needs {cpu} CPU slots ({spec.nproc} ranks) but the daemon has {self.total_cpu}"
        return None

    def take(self, spec: JobSpec) -> list[int] | None:
        """The GPU indices given to the job (empty for a CPU job), or None when it must wait."""
        gpus, cpu = self.need(spec)
        if gpus > len(self.free_gpus) or cpu > self.free_cpu:
            return None
        taken, self.free_gpus = self.free_gpus[:gpus], self.free_gpus[gpus:]
        self.free_cpu -= cpu
        return taken

    def busy_cpu(self) -> int:
        """CPU slots held by running jobs (ranks that occupy a CPU; GPU jobs mostly wait on their devices)."""
        return self.total_cpu - self.free_cpu

    def give_back(self, spec: JobSpec, gpus: list[int]) -> None:
        self.free_gpus = sorted(self.free_gpus + gpus)
        self.free_cpu += self.need(spec)[1]

    def resize_cpu(self, cpu_slots: int) -> None:
        """A reload changed cpu_slots: free slots may go negative until running jobs give theirs back."""
        self.free_cpu += cpu_slots - self.total_cpu
        self.total_cpu = cpu_slots
