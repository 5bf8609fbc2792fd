"""A stand-in for nvidia-ml-py's ``pynvml`` at the library boundary, for daemons under test on CPU.

A test puts this folder first on the daemon's PYTHONPATH and names a JSON file in ``FAKE_NVML``;
every call reads the file afresh, so a test changes what "NVML" reports (a process appears on a
GPU, or leaves it) by rewriting it (`write_state`). The file's shape::

    {"gpus": [{"name": "NVIDIA H200", "uuid": "GPU-...", "memory_total": 150000000000,
               "memory_used": 0, "utilization": 0,
               "processes": [{"pid": 123, "memory": 1048576}],
               "mig": [{"uuid": "MIG-...", "memory_total": ..., "memory_used": ..., "processes": [...]}],
               "fail": ["memory", "utilization", "compute", "graphics", "handle"]}],
     "init_error": null}

``fail`` makes that query of that GPU raise NVMLError (one failing device or query). Each
``nvmlInit`` appends a line to ``<FAKE_NVML>.init`` (a test counts them). Only the calls ddpd
makes are here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

NVML_DEVICE_MIG_ENABLE = 1
NVML_DEVICE_MIG_DISABLE = 0


class NVMLError(Exception):
    """As pynvml's: every NVML failure."""


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
    if gpu.get("utilization") is None:
        raise NVMLError("Not Supported")
    return SimpleNamespace(gpu=int(gpu["utilization"]), memory=0)


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
