"""The machine's GPUs as the daemon sees them, without initialising CUDA.

Discovery and health come from NVML (nvidia-ml-py, ``import pynvml``), which answers from the
driver without a CUDA context: each schedulable device's NVML index, name, UUID, memory and
utilisation, and the processes on it. A GPU in MIG mode is not schedulable itself: its MIG
devices are (``MIG-`` UUIDs, `GpuInfo.mig` their index within the GPU). NVML is initialised once,
on first use, and kept for the daemon's life (an init per call is slow without persistence
mode). One failing device or query costs only its own figures (`GpuInfo.memory_total` None,
`processes` from the query that answered), never the others'.

Where NVML is missing, `discover` asks torch in a child interpreter (bounded by
`FALLBACK_TIMEOUT`) for the devices' names and UUIDs only: nothing that allocates (no
``mem_get_info``), so no CUDA context is made on a GPU a job may be using, and the daemon's own
process never initialises CUDA.

The UUID is a device's identity everywhere: `Resources` places jobs on `GpuInfo.entry` (the UUID,
else the position), a rank's ``CUDA_VISIBLE_DEVICES`` lists UUIDs, and every view shows the NVML
index and the UUID together (`GpuInfo.label`). When the daemon itself runs with
``CUDA_VISIBLE_DEVICES``, `visible` keeps only those devices: NVML indices (nvidia-smi's, as with
``CUDA_DEVICE_ORDER=PCI_BUS_ID``) or UUID prefixes (``GPU-``/``MIG-``), ending at the first entry
that names no device.

`discover` and `processes` block (NVML calls into the driver; the fallback waits for a child):
call them via ``anyio.to_thread.run_sync``, or use `discover_async` / `processes_async`, which do
so on a limiter of their own with a bounded wait. NVML calls are serialised by one lock.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import anyio
import anyio.to_thread

FALLBACK_TIMEOUT = 60.0  # seconds for the torch child (a cold `import torch` takes seconds)
NVML_LOCK_TIMEOUT = 10.0  # seconds to wait for another thread's NVML call before giving up
CALL_TIMEOUT = 30.0  # the async wrappers' bound
MIG_ENABLED = 1  # pynvml.NVML_DEVICE_MIG_ENABLE

_nvml_lock = threading.Lock()
_nvml_lib: Any = None  # the initialised pynvml module, once init succeeded
_limiter: anyio.CapacityLimiter | None = None


class NvmlUnavailable(RuntimeError):
    """NVML cannot answer: nvidia-ml-py is not installed, there is no driver, or a call failed."""


@dataclass(frozen=True)
class GpuInfo:
    """One schedulable device: a GPU, or a MIG device of one. Memory in bytes (None where NVML could
    not say); `utilization` in percent over the driver's last sample period (None where unknown)."""

    index: int  # NVML's index (the parent GPU's for a MIG device); the position where NVML is absent
    name: str
    uuid: str  # GPU-... or MIG-...; "" where unknown (devices counted by the configuration only)
    memory_total: int | None
    memory_used: int | None
    utilization: int | None
    source: Literal["nvml", "torch", "config"]
    mig: int | None = None  # the MIG device's index within its GPU

    @property
    def entry(self) -> str:
        """How ``CUDA_VISIBLE_DEVICES`` names it: the UUID, else the index."""
        return self.uuid or str(self.index)

    @property
    def label(self) -> str:
        """How every view names it: the NVML index (``0``, or ``0/mig1`` for a MIG device)."""
        return f"{self.index}" if self.mig is None else f"{self.index}/mig{self.mig}"


def unnamed(count: int, environ: Mapping[str, str] = os.environ) -> list[GpuInfo]:
    """`count` devices known by position only (a configured count, NVML silent): device i is the
    daemon's own ``CUDA_VISIBLE_DEVICES`` entry i where it has one, else index i."""
    own = [e.strip() for e in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if e.strip()]
    out = []
    for i in range(count):
        entry = own[i] if i < len(own) else str(i)
        out.append(GpuInfo(index=int(entry) if entry.isdigit() else i, name="GPU",
                           uuid="" if entry.isdigit() else entry, memory_total=None, memory_used=None,
                           utilization=None, source="config"))
    return out


@dataclass(frozen=True)
class GpuProcess:
    """A process with a context on a GPU; `memory_used` in bytes (None where the driver hides it)."""

    pid: int
    memory_used: int | None


def _init() -> Any:
    """The pynvml module, initialised on the first call and kept (caller holds the lock)."""
    global _nvml_lib
    if _nvml_lib is not None:
        return _nvml_lib
    try:
        lib: Any = importlib.import_module("pynvml")
    except ImportError as exc:
        raise NvmlUnavailable(f"nvidia-ml-py is not installed: {exc}") from None
    try:
        lib.nvmlInit()
    except Exception as exc:
        raise NvmlUnavailable(f"NVML init failed: {exc}") from None
    _nvml_lib = lib
    return lib


@contextmanager
def nvml() -> Iterator[Any]:
    """The initialised ``pynvml`` module for the block, under the module's lock; an NVML error the
    block lets through becomes NvmlUnavailable."""
    if not _nvml_lock.acquire(timeout=NVML_LOCK_TIMEOUT):
        raise NvmlUnavailable("another NVML call has not returned")
    try:
        lib = _init()
        try:
            yield lib
        except NvmlUnavailable:
            raise
        except lib.NVMLError as exc:
            raise NvmlUnavailable(f"NVML call failed: {exc}") from None
    finally:
        _nvml_lock.release()


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _figures(lib: Any, handle: Any) -> tuple[int | None, int | None, int | None]:
    """(memory total, memory used, utilisation) of one device; None for each query that fails."""
    total: int | None = None
    used: int | None = None
    try:
        mem = lib.nvmlDeviceGetMemoryInfo(handle)
        total, used = int(mem.total), int(mem.used)
    except lib.NVMLError:
        pass
    try:
        util: int | None = int(lib.nvmlDeviceGetUtilizationRates(handle).gpu)
    except lib.NVMLError:  # not supported on some devices (MIG, vGPU)
        util = None
    return total, used, util


def _device(lib: Any, handle: Any, index: int, mig: int | None) -> GpuInfo:
    total, used, util = _figures(lib, handle)
    return GpuInfo(index=index, name=_text(lib.nvmlDeviceGetName(handle)), uuid=_text(lib.nvmlDeviceGetUUID(handle)),
                   memory_total=total, memory_used=used, utilization=util, source="nvml", mig=mig)


def _mig_handles(lib: Any, handle: Any) -> list[tuple[int, Any]]:
    """(MIG index, handle) of each MIG device of a GPU in MIG mode; [] for a GPU without MIG."""
    try:
        current, _pending = lib.nvmlDeviceGetMigMode(handle)
    except (lib.NVMLError, AttributeError):  # not supported: no MIG on this GPU
        return []
    if current != MIG_ENABLED:
        return []
    found = []
    for i in range(int(lib.nvmlDeviceGetMaxMigDeviceCount(handle))):
        try:
            found.append((i, lib.nvmlDeviceGetMigDeviceHandleByIndex(handle, i)))
        except lib.NVMLError:  # an empty slot
            continue
    return found


def _gpu_devices(lib: Any, i: int) -> list[GpuInfo]:
    """GPU `i` as schedulable devices: itself, or its MIG devices; [] where NVML fails on it."""
    try:
        handle = lib.nvmlDeviceGetHandleByIndex(i)
        migs = _mig_handles(lib, handle)
        if migs:
            return [_device(lib, h, i, m) for m, h in migs]
        return [_device(lib, handle, i, None)]
    except lib.NVMLError:  # this GPU cannot be named (fallen off the bus...): the others still can
        return []


def nvml_discover() -> list[GpuInfo]:
    """Every device NVML sees, in its order (a MIG-mode GPU as its MIG devices). Raises NvmlUnavailable."""
    with nvml() as lib:
        return [d for i in range(int(lib.nvmlDeviceGetCount())) for d in _gpu_devices(lib, i)]


def _handle(lib: Any, gpu: GpuInfo) -> Any:
    handle = lib.nvmlDeviceGetHandleByIndex(gpu.index)
    return handle if gpu.mig is None else lib.nvmlDeviceGetMigDeviceHandleByIndex(handle, gpu.mig)


def processes(gpu: GpuInfo) -> list[GpuProcess]:
    """The processes with a compute or graphics context on the device (each query on its own: one
    that fails leaves the other's). Raises NvmlUnavailable when the device or both queries fail."""
    found: dict[int, GpuProcess] = {}
    with nvml() as lib:
        h = _handle(lib, gpu)
        errors = []
        for query in (lib.nvmlDeviceGetComputeRunningProcesses, lib.nvmlDeviceGetGraphicsRunningProcesses):
            try:
                listed = query(h)
            except lib.NVMLError as exc:
                errors.append(str(exc))
                continue
            for p in listed:
                used = getattr(p, "usedGpuMemory", None)
                found[int(p.pid)] = GpuProcess(pid=int(p.pid), memory_used=None if used is None else int(used))
        if len(errors) == 2:
            raise NvmlUnavailable(f"NVML process queries failed on GPU {gpu.label}: {errors[0]}")
    return sorted(found.values(), key=lambda p: p.pid)


def _named(gpus: list[GpuInfo], entry: str) -> list[GpuInfo]:
    """The devices one ``CUDA_VISIBLE_DEVICES`` entry names ([] for none): an NVML index (a MIG-mode
    GPU's index: its MIG devices), or a prefix of exactly one device's UUID."""
    if entry.isdigit():
        return [g for g in gpus if g.index == int(entry)]
    if not entry:
        return []
    prefix = entry if entry.startswith(("GPU-", "MIG-")) else f"GPU-{entry}"
    hits = [g for g in gpus if g.uuid.startswith(prefix)]
    return hits if len(hits) == 1 else []


def visible(gpus: list[GpuInfo], value: str | None) -> list[GpuInfo]:
    """The devices a process with ``CUDA_VISIBLE_DEVICES=value`` sees (None: all), in that order.

    Comma-separated NVML indices or UUID prefixes (``GPU-...``, ``MIG-...``); the list ends at the
    first entry that names no device, or one named twice; empty means none.
    """
    if value is None:
        return list(gpus)
    chosen: list[GpuInfo] = []
    for entry in (e.strip() for e in value.split(",")):
        named = _named(gpus, entry)
        if not named or any(g in chosen for g in named):
            break
        chosen.extend(named)
    return chosen


# names and UUIDs only: get_device_properties allocates nothing (mem_get_info would make a context)
_TORCH_PROBE = """
import json, torch
out = []
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        uuid = str(getattr(p, "uuid", ""))
        out.append({"index": i, "name": p.name, "total": int(p.total_memory),
                    "uuid": uuid if not uuid or uuid.startswith(("GPU-", "MIG-")) else "GPU-" + uuid})
print("DDPD-GPUS " + json.dumps(out))
"""


def parse_probe(text: str) -> list[GpuInfo]:
    """The GPUs the torch probe printed (its ``DDPD-GPUS [...]`` line); ValueError if there is none."""
    for line in text.splitlines():
        if line.startswith("DDPD-GPUS "):
            return [GpuInfo(index=int(g["index"]), name=str(g["name"]), uuid=str(g["uuid"]),
                            memory_total=int(g["total"]), memory_used=None, utilization=None, source="torch")
                    for g in json.loads(line.removeprefix("DDPD-GPUS "))]
    raise ValueError("no GPU report in the probe's output")


def torch_discover(timeout: float = FALLBACK_TIMEOUT) -> list[GpuInfo]:
    """The GPUs torch sees, asked in a child interpreter (CUDA is initialised there, not here).

    The child inherits this environment, so torch applies ``CUDA_VISIBLE_DEVICES`` itself (in PCI
    bus order, as NVML counts). Raises RuntimeError when the child fails or outlasts `timeout`.
    """
    env = {**os.environ, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    try:
        done = subprocess.run([sys.executable, "-c", _TORCH_PROBE], stdin=subprocess.DEVNULL, env=env,
                              capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"torch GPU probe: {exc}") from None
    if done.returncode != 0:
        raise RuntimeError(f"torch GPU probe exited with {done.returncode}: {done.stderr[-2000:]}")
    try:
        return parse_probe(done.stdout)
    except (ValueError, KeyError, TypeError) as exc:
        raise RuntimeError(f"torch GPU probe: {exc}") from None


def discover(environ: Mapping[str, str] = os.environ) -> list[GpuInfo]:
    """The devices this daemon may schedule: NVML's, filtered by its ``CUDA_VISIBLE_DEVICES``; else torch's.

    Raises RuntimeError only when NVML is unavailable and the torch probe fails too.
    """
    try:
        return visible(nvml_discover(), environ.get("CUDA_VISIBLE_DEVICES"))
    except NvmlUnavailable:
        return torch_discover()


def _limit() -> anyio.CapacityLimiter:
    global _limiter
    if _limiter is None:
        _limiter = anyio.CapacityLimiter(2)
    return _limiter


async def discover_async(timeout: float = FALLBACK_TIMEOUT + 5) -> list[GpuInfo]:
    """`discover` in a worker thread of this module's limiter; TimeoutError past `timeout`."""
    with anyio.fail_after(timeout):
        return await anyio.to_thread.run_sync(discover, limiter=_limit(), abandon_on_cancel=True)


async def processes_async(gpu: GpuInfo, timeout: float = CALL_TIMEOUT) -> list[GpuProcess]:
    """`processes` in a worker thread of this module's limiter; TimeoutError past `timeout`."""
    with anyio.fail_after(timeout):
        return await anyio.to_thread.run_sync(processes, gpu, limiter=_limit(), abandon_on_cancel=True)


async def daemon_devices(configured: int | None) -> tuple[list[GpuInfo], str | None]:
    """The devices a daemon schedules, and why discovery failed (None: it did not).

    None configured: `discover` (NVML, else the torch probe). A configured count: the first that
    many devices NVML finds (no torch probe: the count is the operator's word), or as many
    `unnamed` devices where NVML finds fewer; 0: none, NVML not asked.
    """
    if configured == 0:
        return [], None
    try:
        if configured is None:
            return await discover_async(), None
        with anyio.fail_after(CALL_TIMEOUT):
            found = await anyio.to_thread.run_sync(
                lambda: visible(nvml_discover(), os.environ.get("CUDA_VISIBLE_DEVICES")), limiter=_limit(),
                abandon_on_cancel=True)
    except (RuntimeError, TimeoutError) as exc:
        if configured is None:
            return [], str(exc) or "GPU discovery did not answer"
        return unnamed(configured), None
    return (found[:configured], None) if len(found) >= configured else (unnamed(configured), None)
