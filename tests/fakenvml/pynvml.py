"""A stand-in for nvidia-ml-py's ``pynvml`` at the library boundary, for daemons under test on CPU.

A test puts this folder first on the daemon's PYTHONPATH and names a JSON file in ``FAKE_NVML``;
every call reads the file afresh, so a test changes what "NVML" reports (a process appears on a
GPU, or leaves it) by rewriting it (`write_state`). The file's shape::

    {"gpus": [{"name": "NVIDIA H200", "uuid": "GPU-...", "memory_total": 150000000000,
               "memory_used": 0, "utilization": 0,
               "processes": [{"pid": 123, "memory": 1048576}],
               "mig": [{"uuid": "MIG-...", "memory_total": ..., "memory_used": ..., "processes": [...]}],
               "fail": ["memory", "utilization", "compute", "graphics", "handle", "events"]}],
     "events": [{"gpu": 1, "type": "xid", "xid": 79}, {"gpu": 0, "type": "ecc_double"}],
     "init_error": null}

``utilization`` may be a list, a series: each call returns the next value (per process), the last
one kept once the series is spent. ``events`` are what ``nvmlEventSetWait`` delivers, in order,
to every event set on which the event's GPU was registered (`add_event` appends one); a wait with
none pending polls the file until its timeout and raises ``NVMLError_Timeout``.

``fail`` makes that query of that GPU raise NVMLError (one failing device or query). Each
``nvmlInit`` appends a line to ``<FAKE_NVML>.init`` (a test counts them). Only the calls ddpd
makes are here.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

NVML_DEVICE_MIG_ENABLE = 1
NVML_DEVICE_MIG_DISABLE = 0


NVML_ERROR_TIMEOUT = 10
nvmlEventTypeSingleBitEccError = 0x1
nvmlEventTypeDoubleBitEccError = 0x2
nvmlEventTypePState = 0x4
nvmlEventTypeXidCriticalError = 0x8
_EVENT_TYPES = {"ecc_single": nvmlEventTypeSingleBitEccError, "ecc_double": nvmlEventTypeDoubleBitEccError,
                "xid": nvmlEventTypeXidCriticalError}
_series: dict[int, int] = {}  # GPU index -> the utilisation calls answered (a series' position)


class NVMLError(Exception):
    """As pynvml's: every NVML failure (`value` its NVML return code)."""

    value = 999


class NVMLError_Timeout(NVMLError):  # pynvml's name
    value = NVML_ERROR_TIMEOUT


def _state() -> dict[str, Any]:
    path = os.environ.get("FAKE_NVML")
    if not path:
        raise NVMLError("FAKE_NVML is not set")
    data: dict[str, Any] = json.loads(Path(path).read_text())
    return data


def write_state(path: Path, state: dict[str, Any]) -> None:
    """Replace the state atomically (a reader never sees half a file)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    tmp.replace(path)


def nvmlInit() -> None:
    state = _state()
    with open(os.environ["FAKE_NVML"] + ".init", "a") as calls:
        calls.write(f"{os.getpid()}\n")
    if state.get("init_error"):
        raise NVMLError(state["init_error"])


def nvmlShutdown() -> None:
    pass


def nvmlDeviceGetCount() -> int:
    return len(_state()["gpus"])


def _gpu(handle: Any) -> dict[str, Any]:
    gpus = _state()["gpus"]
    gpu: dict[str, Any] = gpus[handle.index]
    if handle.mig is not None:
        migs = gpu.get("mig") or []
        if handle.mig >= len(migs):
            raise NVMLError("Not Found")
        mig: dict[str, Any] = migs[handle.mig]
        return {"name": f"{gpu['name']} MIG", "utilization": None, **mig, "fail": gpu.get("fail", [])}
    return gpu


def _check(gpu: dict[str, Any], query: str) -> None:
    if query in gpu.get("fail", []):
        raise NVMLError(f"Unknown Error ({query})")


def nvmlDeviceGetHandleByIndex(index: int) -> Any:
    gpus = _state()["gpus"]
    if not 0 <= index < len(gpus):
        raise NVMLError("Invalid Argument")
    _check(gpus[index], "handle")
    return SimpleNamespace(index=index, mig=None)


def nvmlDeviceGetName(handle: Any) -> str:
    return str(_gpu(handle)["name"])


def nvmlDeviceGetUUID(handle: Any) -> str:
    return str(_gpu(handle)["uuid"])


def nvmlDeviceGetMemoryInfo(handle: Any) -> Any:
    gpu = _gpu(handle)
    _check(gpu, "memory")
    used = int(gpu.get("memory_used", 0)) + sum(int(p.get("memory", 0)) for p in gpu.get("processes", []))
    return SimpleNamespace(total=int(gpu["memory_total"]), used=used, free=int(gpu["memory_total"]) - used)


def nvmlDeviceGetUtilizationRates(handle: Any) -> Any:
    gpu = _gpu(handle)
    _check(gpu, "utilization")
    value = gpu.get("utilization")
    if value is None:
        raise NVMLError("Not Supported")
    if isinstance(value, list):  # a series: the next value on each call, then the last one
        n = _series.get(handle.index, 0)
        _series[handle.index] = n + 1
        value = value[min(n, len(value) - 1)]
    return SimpleNamespace(gpu=int(value), memory=0)


def _processes(handle: Any, query: str) -> list[Any]:
    gpu = _gpu(handle)
    _check(gpu, query)
    if query == "graphics":
        return []
    return [SimpleNamespace(pid=int(p["pid"]), usedGpuMemory=p.get("memory")) for p in gpu.get("processes", [])]


def nvmlDeviceGetComputeRunningProcesses(handle: Any) -> list[Any]:
    return _processes(handle, "compute")


def nvmlDeviceGetGraphicsRunningProcesses(handle: Any) -> list[Any]:
    return _processes(handle, "graphics")


def nvmlDeviceGetMigMode(handle: Any) -> tuple[int, int]:
    mode = NVML_DEVICE_MIG_ENABLE if _gpu(handle).get("mig") else NVML_DEVICE_MIG_DISABLE
    return mode, mode


def nvmlDeviceGetMaxMigDeviceCount(handle: Any) -> int:
    return 7


def nvmlDeviceGetMigDeviceHandleByIndex(handle: Any, index: int) -> Any:
    migs = _gpu(handle).get("mig") or []
    if not 0 <= index < len(migs):
        raise NVMLError("Not Found")
    return SimpleNamespace(index=handle.index, mig=index)


def add_event(path: Path, gpu: int, kind: str = "xid", xid: int = 0) -> None:
    """Append an event (``xid``, ``ecc_double``, ``ecc_single``) on GPU `gpu` to the state file."""
    state = json.loads(path.read_text())
    state.setdefault("events", []).append({"gpu": gpu, "type": kind, "xid": xid})
    write_state(path, state)


def nvmlEventSetCreate() -> Any:
    return SimpleNamespace(handles={}, delivered=len(_state().get("events", [])))  # only events from now on


def nvmlDeviceRegisterEvents(handle: Any, types: int, event_set: Any) -> None:
    _check(_state()["gpus"][handle.index], "events")
    event_set.handles[handle.index] = (handle, types)


def nvmlEventSetFree(event_set: Any) -> None:
    event_set.handles.clear()


def _next_event(event_set: Any) -> Any | None:
    events = _state().get("events", [])
    while event_set.delivered < len(events):
        event = events[event_set.delivered]
        event_set.delivered += 1
        kind = _EVENT_TYPES[event.get("type", "xid")]
        registered = event_set.handles.get(int(event["gpu"]))
        if registered is not None and registered[1] & kind:
            return SimpleNamespace(device=registered[0], eventType=kind, eventData=int(event.get("xid", 0)),
                                   gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF)
    return None


def nvmlEventSetWait(event_set: Any, timeout_ms: int) -> Any:
    deadline = time.monotonic() + timeout_ms / 1000
    while True:
        event = _next_event(event_set)
        if event is not None:
            return event
        if time.monotonic() >= deadline:
            raise NVMLError_Timeout("Timeout")
        time.sleep(0.05)  # the stand-in's wait (the driver's blocks): events within 50 ms
