"""GPU health: NVML's Xid and ECC events, and GPUs whose NVML calls keep failing.

`EventWatch` registers every watched GPU (by NVML index) for Xid critical-error and double-bit
ECC events on one NVML event set and waits on it with a bounded wait (`EventWatch.wait`, a
blocking call: run it in a worker thread, never on the event loop). Each wait also probes every
GPU at most every `PROBE_EVERY` seconds: one whose handle or UUID cannot be read for
`FAILING_FOR` seconds is a fault too (kind ``nvml``), reported once until it answers again.

A fault is *critical* (the GPU is quarantined) for a double-bit ECC error, for a GPU NVML keeps
failing on, and for the Xids in `CRITICAL_XIDS` (NVIDIA's list of Xids whose action is a GPU reset
or a node reboot: 48 double-bit ECC, 74 NVLink, 79 fallen off the bus, 92 high single-bit ECC
rate, 95 uncontained ECC, 119/120 GSP...); the others (13, 31, 43: usually the application's own
fault) are reported and nothing more. `watch_health` drives a watch from the event loop: each wait
in a thread of its own limiter, bounded, cancellable; the blocking NVML wait never holds the
module's NVML lock (NVML is thread-safe; the lock only serialises `gpus.nvml` blocks).
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

import anyio
import anyio.to_thread

from .gpus import GpuInfo, NvmlUnavailable, nvml

WAIT_SECONDS = 1.0  # one NVML event wait (the thread answers a cancellation within it)
PROBE_EVERY = 5.0  # seconds between probes of every GPU's handle
FAILING_FOR = 30.0  # seconds of failing NVML calls that make a GPU faulty
NVML_ERROR_TIMEOUT = 10
EVENT_SINGLE_BIT_ECC = 0x1  # pynvml.nvmlEventTypeSingleBitEccError
EVENT_DOUBLE_BIT_ECC = 0x2  # pynvml.nvmlEventTypeDoubleBitEccError
EVENT_XID = 0x8  # pynvml.nvmlEventTypeXidCriticalError

XID_NAMES = {
    13: "graphics engine exception", 31: "GPU memory page fault", 43: "GPU stopped processing",
    45: "preemptive cleanup", 48: "double-bit ECC error", 61: "internal micro-controller breakpoint",
    62: "internal micro-controller halt", 63: "ECC page retirement or row remapping recorded",
    64: "ECC page retirement or row remapping failure", 68: "video processor exception",
    74: "NVLink error", 79: "fell off the bus", 92: "high single-bit ECC error rate", 94: "contained ECC error",
    95: "uncontained ECC error", 119: "GSP RPC timeout", 120: "GSP error", 140: "unrecovered ECC error",
}
CRITICAL_XIDS = frozenset({48, 62, 64, 74, 79, 92, 95, 119, 120, 140})


@dataclass(frozen=True)
class GpuFault:
    """What NVML said of a GPU (by NVML index): an Xid, a double-bit ECC error, or failing calls."""

    index: int
    kind: Literal["xid", "ecc", "nvml"]
    what: str  # "Xid 79, fell off the bus"
    xid: int | None = None
    critical: bool = True


def xid_fault(index: int, xid: int) -> GpuFault:
    name = XID_NAMES.get(xid)
    return GpuFault(index=index, kind="xid", xid=xid, critical=xid in CRITICAL_XIDS,
                    what=f"Xid {xid}, {name}" if name else f"Xid {xid}")


def fault_of(index: int, event_type: int, data: int) -> GpuFault | None:
    """The fault one NVML event reports (None: an event type not watched)."""
    if event_type & EVENT_XID:
        return xid_fault(index, data)
    if event_type & EVENT_DOUBLE_BIT_ECC:
        return GpuFault(index=index, kind="ecc", what="double-bit ECC error")
    return None


def _address(handle: Any) -> int | None:
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return None


def _is_timeout(exc: Exception) -> bool:
    return getattr(exc, "value", None) == NVML_ERROR_TIMEOUT


class EventWatch:
    """One NVML event set over the GPUs `indices`; blocking, one thread at a time."""

    def __init__(self, indices: list[int], clock: Callable[[], float] = time.monotonic) -> None:
        self.indices = indices
        self.clock = clock
        self.notes: list[str] = []  # GPUs that cannot be watched for events, and why
        self._lib: Any = None
        self._set: Any = None
        self._handles: list[tuple[int, Any]] = []
        self._failing: dict[int, tuple[float, str]] = {}  # index -> (failing since, last error)
        self._reported: set[int] = set()
        self._probed = float("-inf")
        self._closed = threading.Event()

    def open(self) -> None:
        """Create the event set and register each GPU; a GPU NVML refuses is noted, not fatal.
        Raises NvmlUnavailable when NVML cannot make an event set at all."""
        with nvml() as lib:
            self._lib = lib
            self._set = lib.nvmlEventSetCreate()
            for i in self.indices:
                try:
                    handle = lib.nvmlDeviceGetHandleByIndex(i)
                    lib.nvmlDeviceRegisterEvents(handle, EVENT_XID | EVENT_DOUBLE_BIT_ECC, self._set)
                    self._handles.append((i, handle))
                except lib.NVMLError as exc:
                    self.notes.append(f"GPU {i}: no events ({exc})")

    def _index_of(self, device: Any) -> int | None:
        addr = _address(device)
        for i, handle in self._handles:
            if handle is device or (addr is not None and _address(handle) == addr):
                return i
        return None

    def wait(self, seconds: float = WAIT_SECONDS) -> list[GpuFault]:
        """The faults of one bounded wait: at most one event, and any GPU that became faulty by probe."""
        faults = self._probe()
        if self._closed.is_set():
            return faults
        if not self._handles:
            self._closed.wait(seconds)
            return faults
        lib = self._lib
        try:
            event = lib.nvmlEventSetWait(self._set, int(seconds * 1000))
        except lib.NVMLError as exc:
            if not _is_timeout(exc):  # the wait itself fails: no busy loop, the next probe says more
                self._closed.wait(seconds)
            return faults
        index = self._index_of(event.device)
        fault = None if index is None else fault_of(index, int(event.eventType), int(event.eventData))
        return [*faults, fault] if fault is not None else faults

    def _probe(self) -> list[GpuFault]:
        now = self.clock()
        if now - self._probed < PROBE_EVERY:
            return []
        self._probed = now
        faults = []
        for i in self.indices:
            error = _probe_one(i)
            if error is None:
                self._failing.pop(i, None)
                self._reported.discard(i)
                continue
            since, _ = self._failing.get(i, (now, error))
            self._failing[i] = (since, error)
            if now - since >= FAILING_FOR and i not in self._reported:
                self._reported.add(i)
                faults.append(GpuFault(index=i, kind="nvml",
                                       what=f"NVML calls failing for {now - since:.0f} s ({error})"))
        return faults

    def close(self) -> None:
        """Stop: the next wait returns at once. The event set is kept (one per daemon, for its life):
        freeing it while a thread may still wait on it is not safe."""
        self._closed.set()


def _probe_one(index: int) -> str | None:
    """Why NVML cannot name GPU `index` now (None: it can)."""
    try:
        with nvml() as lib:
            lib.nvmlDeviceGetUUID(lib.nvmlDeviceGetHandleByIndex(index))
    except NvmlUnavailable as exc:
        return str(exc)
    return None


OnFault = Callable[[GpuFault], Awaitable[None]]
_limiter: anyio.CapacityLimiter | None = None


def _limit() -> anyio.CapacityLimiter:
    global _limiter
    if _limiter is None:
        _limiter = anyio.CapacityLimiter(1)  # one watch per daemon: never the default threads' share
    return _limiter


def watched(devices: list[GpuInfo]) -> list[int]:
    """The NVML indices of the devices NVML named (a MIG device's parent GPU once)."""
    return sorted({d.index for d in devices if d.source == "nvml"})


async def watch_health(devices: list[GpuInfo], on_fault: OnFault,
                       on_note: Callable[[list[str]], Awaitable[None]]) -> None:
    """Watch the devices' GPUs until cancelled: each fault to `on_fault`, in order; what cannot be
    watched to `on_note` once. Returns at once for a daemon without NVML-named devices."""
    indices = watched(devices)
    if not indices:
        return
    watch = EventWatch(indices)
    try:
        with anyio.fail_after(30):
            await anyio.to_thread.run_sync(watch.open, limiter=_limit(), abandon_on_cancel=True)
    except (NvmlUnavailable, TimeoutError, AttributeError) as exc:  # AttributeError: an NVML without events
        watch.notes.append(f"no GPU events: {exc}")
    if watch.notes:
        await on_note(watch.notes)
    stuck = False
    try:
        while True:
            try:
                with anyio.fail_after(WAIT_SECONDS + 30):
                    faults = await anyio.to_thread.run_sync(watch.wait, limiter=_limit(), abandon_on_cancel=True)
            except TimeoutError:  # a driver call that does not return: said once; the next wait queues behind it
                if not stuck:
                    await on_note(["an NVML event wait has not returned for 30 s"])
                stuck = True
                continue
            except Exception as exc:  # an NVML without events, a driver's surprise: the watch ends, said
                await on_note([f"the GPU event watch stopped: {exc!r}"])
                return
            stuck = False
            for fault in faults:
                await on_fault(fault)
    finally:
        watch.close()
