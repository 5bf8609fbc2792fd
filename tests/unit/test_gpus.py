"""GPU discovery without CUDA in the daemon's process, the visible-devices rules, and a job's NCCL settings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ddpd.daemon.gpu import gpus
from ddpd.daemon.gpu.gpus import GpuInfo, NvmlUnavailable

REPO = Path(__file__).resolve().parents[2]


def gpu(index: int, uuid: str) -> GpuInfo:
    return GpuInfo(index=index, name="H100", uuid=uuid, memory_total=80 << 30, memory_used=1 << 20,
                   utilization=3, source="nvml")


FOUR = [gpu(0, "GPU-aaaa-0"), gpu(1, "GPU-bbbb-1"), gpu(2, "GPU-cccc-2"), gpu(3, "GPU-abcd-3")]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, [0, 1, 2, 3]),
        ("", []),
        ("0", [0]),
        ("3,1", [3, 1]),
        ("2,7,1", [2]),  # CUDA stops at the first entry that names no GPU
        ("1,1,2", [1]),  # or one named twice
        ("GPU-cccc", [2]),
        ("bbbb,0", [1, 0]),  # a UUID prefix without its GPU- head
        ("GPU-a", []),  # ambiguous prefix: names no single GPU
        ("-1,0", []),
        (" 1 , 2 ", [1, 2]),
    ],
)
def test_visible_follows_cuda_visible_devices_rules(value: str | None, expected: list[int]) -> None:
    assert [g.index for g in gpus.visible(FOUR, value)] == expected


def test_probe_output_parses_to_gpu_infos() -> None:
    report = [{"index": 0, "name": "NVIDIA H200", "uuid": "abc", "total": 100, "used": 7}]
    text = "some warning\nDDPD-GPUS " + json.dumps(report) + "\n"
    assert gpus.parse_probe(text) == [GpuInfo(index=0, name="NVIDIA H200", uuid="abc", memory_total=100,
                                              memory_used=7, utilization=None, source="torch")]
    assert gpus.parse_probe("DDPD-GPUS []") == []
    with pytest.raises(ValueError, match="no GPU report"):
        gpus.parse_probe("Traceback ...")


def test_nvml_missing_is_reported_not_raised_as_import_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # an interpreter without nvidia-ml-py
    with pytest.raises(NvmlUnavailable, match="nvidia-ml-py is not installed"):
        gpus.nvml_discover()
    with pytest.raises(NvmlUnavailable):
        gpus.processes(0)


@pytest.mark.anyio
async def test_processes_async_reports_nvml_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    with pytest.raises(NvmlUnavailable):
        await gpus.processes_async(0, timeout=10)


_DISCOVER = """
import json, sys
from ddpd.daemon.gpu import gpus
try:
    import pynvml
    pynvml.nvmlInit()
    nvml = True
except Exception:
    nvml = False
runs = [gpus.discover()]
if nvml:  # NVML answered: also hide it (an interpreter without nvidia-ml-py) and take the fallback
    sys.modules["pynvml"] = None
    runs.append(gpus.discover())
print(json.dumps({"nvml": nvml, "runs": [sorted({g.source for g in found}) for found in runs],
                  "count": len(runs[-1]), "torch_here": "torch" in sys.modules}))
"""


def test_discover_never_imports_torch_in_the_calling_process() -> None:
    """NVML where it answers; else (not installed, or no driver as on a CPU machine) torch in a child:
    the calling process does not even import torch, so it cannot have initialised CUDA."""
    done = subprocess.run([sys.executable, "-c", _DISCOVER], capture_output=True, text=True, timeout=120,
                          cwd=REPO, check=False)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["torch_here"] is False, out
    if out["nvml"]:
        assert out["runs"][0] in ([], ["nvml"]) and out["runs"][1] in ([], ["torch"]), out
    else:
        assert out["runs"] in ([[]], [["torch"]]), out
        import torch

        if not torch.cuda.is_available():  # a CPU machine: the fallback finds no GPU
            assert out["count"] == 0, out


def test_nccl_env_ties_the_collective_timeout_to_the_job_and_keeps_the_dump_beside_the_logs(tmp_path: Path) -> None:
    env = gpus.nccl_env({"join": 30.0, "heartbeat": 5.0, "progress": 60.0, "kill_grace": 4.0, "wall": None},
                        tmp_path)
    assert all(isinstance(v, str) for v in env.values())
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert int(env["TORCH_NCCL_TRACE_BUFFER_SIZE"]) > 0
    assert env["TORCH_FR_BUFFER_SIZE"] == env["TORCH_NCCL_TRACE_BUFFER_SIZE"]
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(tmp_path / "nccl-trace-rank-")
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    # after the daemon's own diagnosis (progress 60 + heartbeat 5) and teardown (grace 4)
    assert float(env["DDPD_COLLECTIVE_TIMEOUT"]) == 60 + 5 + 4 + gpus.COLLECTIVE_MARGIN


def test_collective_timeout_outlasts_the_join_timeout_and_ignores_bad_values() -> None:
    assert gpus.collective_timeout({"join": 300.0, "progress": 20.0, "heartbeat": 2.0, "kill_grace": 1.0}) == (
        300 + 2 + 1 + gpus.COLLECTIVE_MARGIN)
    defaults = gpus.collective_timeout({})
    assert defaults == gpus.collective_timeout({"progress": None, "join": float("nan"), "heartbeat": -1})
    assert defaults > 600
