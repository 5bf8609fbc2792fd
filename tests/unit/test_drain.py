"""Draining: a GPU job's devices are released once its processes are gone and NVML lists none of them
(a real child process stands in for a rank; the NVML stand-in of tests/fakenvml for the driver)."""

from __future__ import annotations

import sys
from pathlib import Path

import anyio
import pytest

from ddpd.daemon.gpu import drain, gpus

from ..fakenvml import pynvml as fakenvml
from ..fakenvml.pynvml import write_state

pytestmark = pytest.mark.anyio


def state(pids: list[int]) -> dict[str, object]:
    return {"gpus": [{"name": "H200", "uuid": "GPU-0000", "memory_total": 1 << 30, "memory_used": 0,
                      "processes": [{"pid": p, "memory": 1 << 20} for p in pids]}]}


async def test_devices_drain_until_the_process_is_gone_and_nvml_no_longer_lists_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "nvml.json"
    monkeypatch.setenv("FAKE_NVML", str(path))
    monkeypatch.setitem(sys.modules, "pynvml", fakenvml)
    monkeypatch.setattr(gpus, "_nvml_lib", None)
    monkeypatch.setattr(drain, "DRAIN_POLL", 0.05)
    rank = await anyio.open_process([sys.executable, "-c", "import sys; sys.stdin.read()"])
    try:
        write_state(path, state([rank.pid]))
        [device] = gpus.nvml_discover()
        reports: list[tuple[list[int], list[int]]] = []
        waited = anyio.Event()
        released = anyio.Event()

        async def report(left: list[int], listed: list[int]) -> None:
            reports.append((left, listed))
            waited.set()

        async def wait() -> None:
            await drain.wait_drained("j1", [rank.pid], [device], report)
            released.set()

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(wait)
                await waited.wait()
                assert reports == [([rank.pid], [rank.pid])]  # alive (our child) and on the GPU
                assert rank.stdin is not None
                await rank.stdin.aclose()  # the rank exits; NVML still lists it
                await rank.wait()
                assert drain.look("j1", [rank.pid], [device]) == ([], [rank.pid])
                assert not released.is_set()
                write_state(path, state([]))  # the driver lets go
                await released.wait()
        assert len(reports) == 1  # reported once, however long it waited
    finally:
        with anyio.CancelScope(shield=True):
            if rank.returncode is None:
                rank.kill()
            await rank.wait()


async def test_nothing_left_releases_at_once_without_a_report() -> None:
    async def report(left: list[int], listed: list[int]) -> None:
        raise AssertionError("nothing to wait for")

    with anyio.fail_after(10):
        await drain.wait_drained("j1", [2**22 + 12345], [], report)  # no such process, no device
