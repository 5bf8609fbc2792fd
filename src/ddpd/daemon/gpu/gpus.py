"""The machine's GPUs as the daemon sees them, without initialising CUDA; and a job's NCCL settings.

Discovery and health come from NVML (nvidia-ml-py, ``import pynvml``), which answers from the
driver without a CUDA context: each GPU's index, name, UUID, memory and utilisation, and the
processes on it. Where NVML is missing or fails, `discover` asks torch in a child interpreter
(bounded by `FALLBACK_TIMEOUT`), so the daemon's own process never initialises CUDA: a
long-lived process would otherwise hold the driver, and the runtime would read
``CUDA_VISIBLE_DEVICES`` once, there.

Indices are NVML's (PCI bus order); `nccl_env` sets ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` for the
ranks, so ``CUDA_VISIBLE_DEVICES=3`` names the GPU that NVML calls 3. When the daemon itself runs
with ``CUDA_VISIBLE_DEVICES``, `discover` keeps only those GPUs (CUDA's rules: indices or UUID
prefixes, the list ends at the first entry that names no GPU).

`discover` and `processes` block (NVML calls into the driver; the fallback waits for a child):
call them via ``anyio.to_thread.run_sync``, or use `discover_async` / `processes_async`, which
do so on a limiter of their own with a bounded wait. NVML calls are serialised by one lock.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import anyio
import anyio.to_thread

FALLBACK_TIMEOUT = 60.0  # seconds for the torch child (a cold `import torch` takes seconds)
NVML_LOCK_TIMEOUT = 10.0  # seconds to wait for another thread's NVML call before giving up
CALL_TIMEOUT = 30.0  # the async wrappers' bound
TRACE_BUFFER_SIZE = 2000  # NCCL flight recorder entries per rank
# the worker reads the same name (ddpd.worker.loop.COLLECTIVE_TIMEOUT_ENV)
COLLECTIVE_TIMEOUT_ENV = "DDPD_COLLECTIVE_TIMEOUT"
COLLECTIVE_MARGIN = 30.0  # seconds past the daemon's own hang detection and teardown
NCCL_TRACE_PREFIX = "nccl-trace-rank-"  # torch appends the rank

_nvml_lock = threading.Lock()
_limiter: anyio.CapacityLimiter | None = None


class NvmlUnavailable(RuntimeError):
    """NVML cannot answer: nvidia-ml-py is not installed, there is no driver, or a call failed."""


@dataclass(frozen=True)
class GpuInfo:
    """One GPU. Memory in bytes; `utilization` in percent over the driver's last sample period
    (None where unknown, as from the torch fallback)."""

    index: int
    name: str
    uuid: str
    memory_total: int
    memory_used: int
    utilization: int | None
    source: Literal["nvml", "torch"]


@dataclass(frozen=True)
class GpuProcess:
    """A process with a context on a GPU; `memory_used` in bytes (None where the driver hides it)."""

    pid: int
    memory_used: int | None


@contextmanager
def nvml() -> Iterator[Any]:
    """The initialised ``pynvml`` module for the block (NVML is reference-counted: init, shut down)."""
    if not _nvml_lock.acquire(timeout=NVML_LOCK_TIMEOUT):
        raise NvmlUnavailable("another NVML call has not returned")
    try:
        try:
            lib: Any = importlib.import_module("pynvml")
        except ImportError as exc:
            raise NvmlUnavailable(f"nvidia-ml-py is not installed: {exc}") from None
        try:
            lib.nvmlInit()
        except Exception as exc:
            raise NvmlUnavailable(f"NVML init failed: {exc}") from None
        try:
            yield lib
        except NvmlUnavailable:
            raise
        except Exception as exc:
            if isinstance(exc, lib.NVMLError):
                raise NvmlUnavailable(f"NVML call failed: {exc}") from None
            raise
        finally:
            try:
                lib.nvmlShutdown()
            except Exception:
                pass
    finally:
        _nvml_lock.release()


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def nvml_discover() -> list[GpuInfo]:
    """Every GPU NVML sees, in its order. Raises NvmlUnavailable."""
    out = []
    with nvml() as lib:
        for i in range(int(lib.nvmlDeviceGetCount())):
            h = lib.nvmlDeviceGetHandleByIndex(i)
            mem = lib.nvmlDeviceGetMemoryInfo(h)
            try:
                util: int | None = int(lib.nvmlDeviceGetUtilizationRates(h).gpu)
            except lib.NVMLError:  # not supported on some devices (MIG, vGPU)
                util = None
            out.append(GpuInfo(index=i, name=_text(lib.nvmlDeviceGetName(h)), uuid=_text(lib.nvmlDeviceGetUUID(h)),
                               memory_total=int(mem.total), memory_used=int(mem.used), utilization=util,
                               source="nvml"))
    return out


def processes(index: int) -> list[GpuProcess]:
    """The processes with a compute or graphics context on GPU `index` (NVML's). Raises NvmlUnavailable."""
    found: dict[int, GpuProcess] = {}
    with nvml() as lib:
        h = lib.nvmlDeviceGetHandleByIndex(index)
        for query in (lib.nvmlDeviceGetComputeRunningProcesses, lib.nvmlDeviceGetGraphicsRunningProcesses):
            for p in query(h):
                used = getattr(p, "usedGpuMemory", None)
                found[int(p.pid)] = GpuProcess(pid=int(p.pid), memory_used=None if used is None else int(used))
    return sorted(found.values(), key=lambda p: p.pid)


def visible(gpus: list[GpuInfo], value: str | None) -> list[GpuInfo]:
    """The GPUs a process with ``CUDA_VISIBLE_DEVICES=value`` sees (None: all), in that order.

    As CUDA reads it: comma-separated indices or UUID prefixes (``GPU-...``); the list ends at the
    first entry that names no GPU, or one named twice; empty means none.
    """
    if value is None:
        return list(gpus)
    chosen: list[GpuInfo] = []
    for entry in (e.strip() for e in value.split(",")):
        match = None
        if entry.isdigit():
            match = next((g for g in gpus if g.index == int(entry)), None)
        elif entry:
            prefix = entry if entry.startswith(("GPU-", "MIG-")) else f"GPU-{entry}"
            hits = [g for g in gpus if g.uuid.startswith(prefix)]
            match = hits[0] if len(hits) == 1 else None
        if match is None or match in chosen:
            break
        chosen.append(match)
    return chosen


_TORCH_PROBE = """
import json, torch
out = []
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        free, total = torch.cuda.mem_get_info(i)
        out.append({"index": i, "name": p.name, "uuid": str(getattr(p, "uuid", "")), "total": total,
                    "used": total - free})
print("DDPD-GPUS " + json.dumps(out))
"""


def parse_probe(text: str) -> list[GpuInfo]:
    """The GPUs the torch probe printed (its ``DDPD-GPUS [...]`` line); ValueError if there is none."""
    for line in text.splitlines():
        if line.startswith("DDPD-GPUS "):
            return [GpuInfo(index=int(g["index"]), name=str(g["name"]), uuid=str(g["uuid"]),
                            memory_total=int(g["total"]), memory_used=int(g["used"]), utilization=None,
                            source="torch")
                    for g in json.loads(line.removeprefix("DDPD-GPUS "))]
    raise ValueError("no GPU report in the probe's output")


def torch_discover(timeout: float = FALLBACK_TIMEOUT) -> list[GpuInfo]:
    """The GPUs torch sees, asked in a child interpreter (CUDA is initialised there, not here).

    The child inherits this environment, so torch applies ``CUDA_VISIBLE_DEVICES`` itself.
    Raises RuntimeError when the child fails or outlasts `timeout`.
    """
    try:
        done = subprocess.run([sys.executable, "-c", _TORCH_PROBE], stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"torch GPU probe: {exc}") from None
    if done.returncode != 0:
        raise RuntimeError(f"torch GPU probe exited with {done.returncode}: {done.stderr[-2000:]}")
    return parse_probe(done.stdout)


def discover(environ: Mapping[str, str] = os.environ) -> list[GpuInfo]:
    """The GPUs this daemon may schedule: NVML's, filtered by its ``CUDA_VISIBLE_DEVICES``; else torch's.

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


async def processes_async(index: int, timeout: float = CALL_TIMEOUT) -> list[GpuProcess]:
    """`processes` in a worker thread of this module's limiter; TimeoutError past `timeout`."""
    with anyio.fail_after(timeout):
        return await anyio.to_thread.run_sync(processes, index, limiter=_limit(), abandon_on_cancel=True)


def collective_timeout(timeouts: Mapping[str, Any]) -> float:
    """Seconds a rank's collective may wait before NCCL (or gloo) gives up on it.

    Past the daemon's own diagnosis: a stuck rank is found by the progress timeout (or the join
    timeout before the first step, whichever is longer), its stacks are dumped and the group is
    torn down within the kill grace. The backend's timeout comes after that, by `COLLECTIVE_MARGIN`,
    so the daemon names the stuck rank before a waiting peer fails with a timeout of its own; it
    still ends a wait that nothing else would (a daemon with the progress watch off).
    """
    def seconds(key: str, default: float) -> float:
        value = timeouts.get(key)
        return float(value) if isinstance(value, int | float) and math.isfinite(value) and value > 0 else default

    detect = max(seconds("progress", 600.0), seconds("join", 120.0)) + seconds("heartbeat", 10.0)
    return detect + seconds("kill_grace", 5.0) + COLLECTIVE_MARGIN


def nccl_env(timeouts: Mapping[str, Any], attempt_dir: str | os.PathLike[str]) -> dict[str, str]:
    """The environment a rank of one attempt gets for CUDA and NCCL, from the job's resolved timeouts.

    - ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``: a failed or timed-out collective aborts the
      communicator and ends the rank (the daemon sees the exit) instead of hanging it;
    - ``DDPD_COLLECTIVE_TIMEOUT``: the process group's timeout (`collective_timeout`), which the
      built-in loop passes to ``init_process_group``;
    - the flight recorder: ``TORCH_NCCL_TRACE_BUFFER_SIZE`` (and its newer name
      ``TORCH_FR_BUFFER_SIZE``) entries, dumped on a timeout (``TORCH_NCCL_DUMP_ON_TIMEOUT``) to
      ``<attempt_dir>/nccl-trace-rank-<rank>``, beside the rank logs;
    - ``CUDA_DEVICE_ORDER=PCI_BUS_ID``: CUDA numbers GPUs as NVML does.

    The job's own ``env`` is applied after these, so a job can override any of them.
    """
    trace = str(Path(attempt_dir) / NCCL_TRACE_PREFIX)
    return {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        COLLECTIVE_TIMEOUT_ENV: f"{collective_timeout(timeouts):g}",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": str(TRACE_BUFFER_SIZE),
        "TORCH_FR_BUFFER_SIZE": str(TRACE_BUFFER_SIZE),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": trace,
        "TORCH_FR_DUMP_TEMP_FILE": trace,
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
    }
