"""The GPU figures a user sees: `ddpctl daemon` shows each GPU's memory, utilisation and the job
holding it; `ddpctl status` shows each rank's GPU and the memory its process holds there (NVML)."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from ddpd.protocol import JobState

from ..conftest import DaemonProc, assert_nothing_left
from ..integration.test_gpu_placement import shown
from ..scripts.helpers import gated, wait_waiting_at_gate
from .conftest import GpuWatch

pytestmark = pytest.mark.anyio


async def test_daemon_and_status_show_the_gpu_its_job_and_the_ranks_memory(
    gpu_daemon: DaemonProc, gpu_watch: GpuWatch, tmp_path: Path
) -> None:
    d = gpu_daemon
    gate = tmp_path / "gate"
    job_id = await d.client.submit(gated(d, gate, nproc=1, gpus_per_rank=1, device="cuda"))
    await wait_waiting_at_gate(d, job_id)  # the model is on its GPU, step 1 held
    info = await d.client.daemon_info()
    assert info.gpu_note is None and info.gpu_devices, info
    view = await d.client.status(job_id)
    [gpu] = view.ranks[0].gpus
    held = next(g for g in info.gpu_devices if g.index == gpu.index)
    assert held.memory_used is not None and held.memory_total is not None
    assert job_id in held.jobs and held.memory_used > 0 and held.memory_total >= held.memory_used
    if await gpu_watch.saw_ranks(view):  # NVML lists the rank's pid (not in a container's pid namespace)
        assert gpu.memory_used is not None and gpu.memory_used > 0
    daemon_text, status_text = await shown(d, "daemon"), await shown(d, "status", job_id)
    print(f"ddpctl daemon:\n{daemon_text}\nddpctl status:\n{status_text}")  # for scripts/gpu-check's report
    # one name everywhere: the NVML index with the UUID
    assert held.uuid == gpu.uuid and gpu.uuid.startswith(("GPU-", "MIG-"))
    assert f"gpu {gpu.index}" in daemon_text and gpu.uuid in daemon_text and job_id in daemon_text
    assert "gpu" in status_text and f"{gpu.index} {gpu.uuid[:12]}" in status_text  # the UUID's first 8 hex digits
    gate.touch()
    with anyio.fail_after(120):
        done = await d.client.wait(job_id)
    assert done.state == JobState.SUCCEEDED, done.root_cause
    assert_nothing_left([done])
    gpu_watch.assert_free([done])
