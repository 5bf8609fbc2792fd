"""GPU health in process: which faults quarantine, the NVML event watch over the stand-in (events in
order, a bounded wait that times out, failing calls become a fault after FAILING_FOR), naming a GPU
for `gpu release`, and the utilisation log's idle spells and recent samples."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from ddpd.daemon.gpu import gpus, health
from ddpd.daemon.gpu.gpus import GpuInfo
from ddpd.daemon.gpu.utilisation import UtilisationLog, sample
from ddpd.daemon.queue.gpuhealth import find_device, gpu_name

from ..fakenvml import pynvml as fakenvml
from ..fakenvml.pynvml import add_event, write_state


def _state(n: int) -> dict[str, Any]:
    return {"gpus": [{"name": "NVIDIA H200", "uuid": f"GPU-{i}000aaaa", "memory_total": 100 << 30,
                      "utilization": [0, 0, 30], "processes": []} for i in range(n)]}


@pytest.fixture
def fake_nvml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    state = tmp_path / "nvml.json"
    write_state(state, _state(2))
    monkeypatch.setenv("FAKE_NVML", str(state))
    monkeypatch.setitem(sys.modules, "pynvml", fakenvml)
    monkeypatch.setattr(gpus, "_nvml_lib", None)
    monkeypatch.setattr(fakenvml, "_series", {})
    return state


def test_critical_xids_quarantine_and_application_xids_do_not() -> None:
    assert health.xid_fault(3, 79) == health.GpuFault(index=3, kind="xid", xid=79, what="Xid 79, fell off the bus")
    assert health.xid_fault(0, 48).critical and health.xid_fault(0, 74).critical
    assert not health.xid_fault(0, 13).critical and not health.xid_fault(0, 31).critical
    assert health.xid_fault(0, 999).what == "Xid 999" and not health.xid_fault(0, 999).critical
    assert health.fault_of(1, health.EVENT_DOUBLE_BIT_ECC, 0) == health.GpuFault(1, "ecc", "double-bit ECC error")
    assert health.fault_of(1, health.EVENT_SINGLE_BIT_ECC, 0) is None


def test_the_watch_reports_events_in_order_and_its_wait_is_bounded(fake_nvml: Path) -> None:
    add_event(fake_nvml, 0, xid=43)  # before the watch: not delivered
    watch = health.EventWatch([0, 1])
    watch.open()
    assert watch.notes == []
    assert watch.wait(0.05) == []  # nothing pending: the wait times out, bounded
    add_event(fake_nvml, 1, xid=79)
    add_event(fake_nvml, 0, kind="ecc_double")
    assert watch.wait(1) == [health.xid_fault(1, 79)]
    assert watch.wait(1) == [health.GpuFault(0, "ecc", "double-bit ECC error")]
    watch.close()
    assert watch.wait(5) == []  # closed: returns at once


def test_a_gpu_nvml_keeps_failing_on_becomes_one_fault(fake_nvml: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    watch = health.EventWatch([0, 1], clock=lambda: now[0])
    watch.open()
    state = _state(2)
    state["gpus"][1]["fail"] = ["handle"]
    write_state(fake_nvml, state)
    faults = []
    for _ in range(8):  # one probe every PROBE_EVERY seconds
        faults += watch.wait(0.01)
        now[0] += health.PROBE_EVERY
    assert [(f.index, f.kind) for f in faults] == [(1, "nvml")]
    assert "NVML calls failing for 30 s" in faults[0].what


def test_a_gpu_is_named_by_index_uuid_or_prefix() -> None:
    devices = [GpuInfo(index=i, name="G", uuid=f"GPU-{i}{i}aa", memory_total=None, memory_used=None,
                       utilization=None, source="nvml") for i in (2, 3)]
    assert find_device(devices, "3") == devices[1]
    assert find_device(devices, "GPU-22aa") == devices[0] and find_device(devices, "GPU-33") == devices[1]
    assert find_device(devices, "GPU-") is None and find_device(devices, "7") is None  # ambiguous, absent
    assert gpu_name(devices[1]) == "GPU 3 (GPU-33aa)"


def test_the_utilisation_log_knows_idle_spells_and_recent_samples(fake_nvml: Path) -> None:
    devices = gpus.nvml_discover()
    assert sample(devices) == {"GPU-0000aaaa": 0, "GPU-1000aaaa": 0}  # the series' first values
    log = UtilisationLog(keep=100)
    for t, percent in [(0, 50), (10, 0), (20, 0), (30, 0)]:
        log.add(t, {"a": percent, "b": None})
    assert log.idle_since("a") == 10 and log.idle_since("b") is None
    log.add(40, {"a": 7})
    assert log.idle_since("a") is None
    assert log.recent("a", now=40, span=25) == [0, 0, 7]
    assert log.recent("a", now=40, span=100, most=2) == [0, 7]  # thinned, the newest kept
    log.add(200, {"a": 0})
    assert list(log.samples["a"]) == [(200, 0)]  # older than `keep`: gone
