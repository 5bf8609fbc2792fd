"""GPU discovery without CUDA in the daemon's process (NVML once, per-device errors, MIG), the visible-devices
rules, and the environment every rank starts with (collective timeout, NCCL's flight recorder)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ddpd.daemon.config import Config
from ddpd.daemon.gpu import gpus, rankenv
from ddpd.daemon.gpu.gpus import GpuInfo, NvmlUnavailable
from ddpd.protocol import Timeouts

from ..fakenvml import pynvml as fakenvml
from ..fakenvml.pynvml import write_state

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


def test_mig_devices_are_named_by_their_uuids_or_their_gpus() -> None:
    migs = [GpuInfo(index=1, name="A100 MIG", uuid=f"MIG-{m}aaa", memory_total=1, memory_used=0, utilization=None,
                    source="nvml", mig=m) for m in range(2)]
    found = [FOUR[0], *migs]
    assert gpus.visible(found, "MIG-1aaa") == [migs[1]]
    assert gpus.visible(found, "1") == migs  # a MIG-mode GPU by index: its MIG devices
    assert [g.label for g in gpus.visible(found, "MIG-0aaa,0")] == ["1/mig0", "0"]


def test_probe_output_parses_to_gpu_infos_without_memory_figures() -> None:
    report = [{"index": 0, "name": "NVIDIA H200", "uuid": "GPU-abc", "total": 100}]
    text = "some warning\nDDPD-GPUS " + json.dumps(report) + "\n"
    assert gpus.parse_probe(text) == [GpuInfo(index=0, name="NVIDIA H200", uuid="GPU-abc", memory_total=100,
                                              memory_used=None, utilization=None, source="torch")]
    assert gpus.parse_probe("DDPD-GPUS []") == []
    with pytest.raises(ValueError, match="no GPU report"):
        gpus.parse_probe("Traceback ...")


def test_the_probe_allocates_nothing_on_a_gpu() -> None:
    """mem_get_info would create a CUDA context on every GPU, busy ones included."""
    assert "mem_get_info" not in gpus._TORCH_PROBE and "get_device_properties" in gpus._TORCH_PROBE


def test_nvml_missing_is_reported_not_raised_as_import_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # an interpreter without nvidia-ml-py
    monkeypatch.setattr(gpus, "_nvml_lib", None)
    with pytest.raises(NvmlUnavailable, match="nvidia-ml-py is not installed"):
        gpus.nvml_discover()
    with pytest.raises(NvmlUnavailable):
        gpus.processes(FOUR[0])


@pytest.mark.anyio
async def test_processes_async_reports_nvml_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setattr(gpus, "_nvml_lib", None)
    with pytest.raises(NvmlUnavailable):
        await gpus.processes_async(FOUR[0], timeout=10)


def _state(n: int) -> dict[str, Any]:
    return {"gpus": [{"name": "NVIDIA H200", "uuid": f"GPU-{i}000", "memory_total": 100 << 30, "memory_used": 1 << 30,
                      "utilization": 10 * i, "processes": []} for i in range(n)]}


@pytest.fixture
def fake_nvml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The test stand-in for pynvml (tests/fakenvml) as this process's pynvml; its state file."""
    state = tmp_path / "nvml.json"
    write_state(state, _state(3))
    monkeypatch.setenv("FAKE_NVML", str(state))
    monkeypatch.setitem(sys.modules, "pynvml", fakenvml)
    monkeypatch.setattr(gpus, "_nvml_lib", None)
    return state


def test_nvml_is_initialised_once_for_many_calls(fake_nvml: Path) -> None:
    for _ in range(3):
        assert [g.uuid for g in gpus.nvml_discover()] == ["GPU-0000", "GPU-1000", "GPU-2000"]
        gpus.processes(FOUR[0])
    assert len(Path(f"{fake_nvml}.init").read_text().splitlines()) == 1


def test_one_failing_gpu_or_query_costs_only_its_own_figures(fake_nvml: Path) -> None:
    state = _state(3)
    state["gpus"][0]["fail"] = ["memory", "compute"]
    state["gpus"][1]["fail"] = ["handle"]  # fallen off the bus: the others are still listed
    state["gpus"][2]["processes"] = [{"pid": 42, "memory": 5}]
    write_state(fake_nvml, state)
    found = gpus.nvml_discover()
    assert [(g.index, g.memory_total, g.utilization) for g in found] == [(0, None, 0), (2, 100 << 30, 20)]
    assert gpus.processes(found[0]) == []  # compute failed, graphics answered
    assert gpus.processes(found[1]) == [gpus.GpuProcess(pid=42, memory_used=5)]
    state["gpus"][0]["fail"] = ["compute", "graphics"]
    write_state(fake_nvml, state)
    with pytest.raises(NvmlUnavailable, match="GPU 0"):
        gpus.processes(found[0])


def test_a_mig_mode_gpu_is_scheduled_as_its_mig_devices(fake_nvml: Path) -> None:
    state = _state(2)
    state["gpus"][1]["mig"] = [{"uuid": "MIG-aaaa", "memory_total": 10, "memory_used": 0, "processes": []},
                               {"uuid": "MIG-bbbb", "memory_total": 10, "memory_used": 0,
                                "processes": [{"pid": 7, "memory": 3}]}]
    write_state(fake_nvml, state)
    found = gpus.nvml_discover()
    assert [(g.label, g.uuid) for g in found] == [("0", "GPU-0000"), ("1/mig0", "MIG-aaaa"), ("1/mig1", "MIG-bbbb")]
    assert gpus.processes(found[2]) == [gpus.GpuProcess(pid=7, memory_used=3)]
    assert [g.uuid for g in gpus.discover({"CUDA_VISIBLE_DEVICES": "MIG-bbbb,0"})] == ["MIG-bbbb", "GPU-0000"]


@pytest.mark.anyio
async def test_a_configured_count_takes_nvmls_first_devices_or_names_them_by_position(fake_nvml: Path) -> None:
    found, problem = await gpus.daemon_devices(2)
    assert problem is None and [g.uuid for g in found] == ["GPU-0000", "GPU-1000"]
    found, _ = await gpus.daemon_devices(5)  # more than NVML lists: the operator's count, by position
    assert [g.entry for g in found] == ["0", "1", "2", "3", "4"] and {g.source for g in found} == {"config"}
    assert await gpus.daemon_devices(0) == ([], None)


_DISCOVER = """
import json, sys
if sys.argv[1] == "hide":  # an interpreter without nvidia-ml-py: discovery must take the fallback
    sys.modules["pynvml"] = None
from ddpd.daemon.gpu import gpus, rankenv
try:
    import pynvml
    pynvml.nvmlInit()
    nvml = True
except Exception:
    nvml = False
found = gpus.discover()
print(json.dumps({"nvml": nvml, "sources": sorted({g.source for g in found}), "count": len(found),
                  "torch_here": "torch" in sys.modules}))
"""


def _discover_in_child(mode: str) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-c", _DISCOVER, mode], capture_output=True, text=True,
                          timeout=120, cwd=REPO, check=False)
    assert done.returncode == 0, done.stderr
    out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["torch_here"] is False, out
    return out


def test_discover_never_imports_torch_in_the_calling_process() -> None:
    """NVML where it answers; else (not installed, or no driver as on a CPU machine) torch in a child:
    the calling process does not even import torch, so it cannot have initialised CUDA. Each discovery
    runs in an interpreter of its own (NVML, once initialised, is kept for the process's life)."""
    out = _discover_in_child("plain")
    hidden = _discover_in_child("hide")
    assert hidden["nvml"] is False, hidden
    if out["nvml"]:
        assert out["sources"] in ([], ["nvml"]) and hidden["sources"] in ([], ["torch"]), (out, hidden)
        assert hidden["count"] == out["count"], (out, hidden)
    else:
        assert out["sources"] in ([], ["torch"]) and hidden["sources"] == out["sources"], (out, hidden)
        import torch

        if not torch.cuda.is_available():  # a CPU machine: the fallback finds no GPU
            assert out["count"] == 0, out


def test_every_job_gets_a_collective_timeout_and_gpu_jobs_the_flight_recorder(tmp_path: Path) -> None:
    defaults = Config(defaults=Timeouts(join=30.0, heartbeat=5.0, progress=60.0, kill_grace=4.0)).defaults
    timeouts = Timeouts().over(defaults)
    cpu = rankenv.rank_defaults(timeouts, tmp_path, gpus=False)
    # after the daemon's own diagnosis (progress 60 + heartbeat 5) and teardown (grace 4), by a minute
    assert cpu == {"DDPD_COLLECTIVE_TIMEOUT": f"{60 + 5 + 4 + 60:g}"}
    env = rankenv.rank_defaults(timeouts, tmp_path, gpus=True)
    assert all(isinstance(v, str) for v in env.values())
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in env  # torch's default (3) unless the job sets it
    assert "CUDA_DEVICE_ORDER" not in env  # reserved: the launch sets it for every rank
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert int(env["TORCH_NCCL_TRACE_BUFFER_SIZE"]) > 0
    assert env["TORCH_FR_BUFFER_SIZE"] == env["TORCH_NCCL_TRACE_BUFFER_SIZE"]
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(tmp_path / "nccl-trace-rank-")
    assert env["DDPD_COLLECTIVE_TIMEOUT"] == cpu["DDPD_COLLECTIVE_TIMEOUT"]


def test_collective_timeout_outlasts_the_join_timeout_and_the_job_s_own_timeouts_win() -> None:
    spec = Timeouts(join=300.0, progress=20.0, heartbeat=2.0, kill_grace=1.0)
    assert rankenv.collective_timeout(spec.over(Config().defaults)) == 300 + 2 + 1 + rankenv.COLLECTIVE_MARGIN
    assert rankenv.collective_timeout(Timeouts().over(Config().defaults)) == 600 + 10 + 5 + rankenv.COLLECTIVE_MARGIN
