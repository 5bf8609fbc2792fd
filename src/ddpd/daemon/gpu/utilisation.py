"""Each GPU's utilisation over the last minutes: samples read from NVML off the loop, kept per device.

`sample` asks NVML for every device's utilisation (percent over the driver's last sample period;
None where it cannot say); `UtilisationLog` keeps each device's samples of the last `KEEP` seconds
and says how long a device has been at 0% (`idle_since`) and what it did lately (`recent`, what
`ddpctl status` shows per rank). The queue's idle watch (`queue.gpuhealth`) samples and decides.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import anyio
import anyio.to_thread

from .gpus import GpuInfo, NvmlUnavailable, _handle, nvml

KEEP = 3600.0  # seconds of samples kept per device
RECENT = 300.0  # seconds `recent` covers (status: the last five minutes)
RECENT_MAX = 30  # samples `recent` gives at most (evenly spaced over RECENT)
SAMPLE_TIMEOUT = 5.0


def sample(devices: Iterable[GpuInfo]) -> dict[str, int | None]:
    """Each device's utilisation now, by entry (None where NVML cannot say). Raises NvmlUnavailable."""
    out: dict[str, int | None] = {}
    with nvml() as lib:
        for gpu in devices:
            try:
                out[gpu.entry] = int(lib.nvmlDeviceGetUtilizationRates(_handle(lib, gpu)).gpu)
            except lib.NVMLError:
                out[gpu.entry] = None
    return out


async def sample_async(devices: list[GpuInfo]) -> dict[str, int | None]:
    """`sample` in a worker thread, bounded: {} where NVML cannot answer in time."""
    try:
        with anyio.fail_after(SAMPLE_TIMEOUT):
            return await anyio.to_thread.run_sync(sample, devices, abandon_on_cancel=True)
    except (NvmlUnavailable, TimeoutError):
        return {}


class UtilisationLog:
    """Per device entry: (time, percent) samples of the last `keep` seconds."""

    def __init__(self, keep: float = KEEP) -> None:
        self.keep = keep
        self.samples: dict[str, deque[tuple[float, int]]] = {}

    def add(self, at: float, figures: dict[str, int | None]) -> None:
        for entry, percent in figures.items():
            kept = self.samples.setdefault(entry, deque())
            if percent is not None:
                kept.append((at, percent))
            while kept and kept[0][0] < at - self.keep:
                kept.popleft()

    def idle_since(self, entry: str) -> float | None:
        """When the device's current run of 0% samples began (None: no sample, or the last is busy)."""
        since = None
        for at, percent in reversed(self.samples.get(entry, ())):
            if percent != 0:
                break
            since = at
        return since

    def recent(self, entry: str, now: float, span: float = RECENT, most: int = RECENT_MAX) -> list[int]:
        """The device's samples of the last `span` seconds, oldest first, thinned to at most `most`."""
        kept = [p for at, p in self.samples.get(entry, ()) if at >= now - span]
        step = max(1, -(-len(kept) // most))
        return kept[::-1][::step][::-1]  # the newest sample always among them
