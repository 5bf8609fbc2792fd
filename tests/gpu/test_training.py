"""CUDA training through the daemon: the seed program on one GPU (fractions), the physical GPU by UUID, two
jobs sharing a GPU, NCCL (task and script), no host sync within a step, bf16, resume."""

from __future__ import annotations

import math
import os
import re
import signal
from pathlib import Path

import anyio
import pytest

from ddpd.protocol import JobState
from ddpd.protocol.control import JobView

from ..conftest import REPO, DaemonProc, assert_nothing_left
from ..scripts.helpers import gated, rank_reports, wait_waiting_at_gate
from .conftest import GpuWatch, gpu_count, log_of, needs_gpus

pytestmark = pytest.mark.anyio


def succeeded(job: JobView) -> None:
    assert job.state == JobState.SUCCEEDED, (job.reason, job.root_cause, [log_of(job, r.rank)[-3000:]
                                                                           for r in job.ranks])


async def test_seed_program_gloo_with_cuda_tensors_two_ranks_share_one_gpu(gpu_daemon: DaemonProc,
                                                                           gpu_watch: GpuWatch) -> None:
    """The classic program both ways, with two ranks on one GPU (gpus_per_rank 0.5): as the built-in
    two-layer task (gloo, device auto) and as the unmodified script; equal parameters on both ranks."""
    d = gpu_daemon
    task = await d.run(d.spec(task="tests.gpu.tasks:report_device", nproc=2, steps=20, backend="gloo",
                              gpus_per_rank=0.5, options={"require_cuda": True}))
    succeeded(task)
    for r in (0, 1):
        assert "DEVICE cuda:0 count=1" in log_of(task, r)
    assert task.ranks[0].checksum == task.ranks[1].checksum is not None

    script = await d.run(d.spec(script=[str(REPO / "tests/gpu/seed_script.py")], nproc=2, gpus_per_rank=0.5))
    succeeded(script)
    lines = [re.search(r"SEED done rank=(\d) device=(\d) checksum=(\S+)", log_of(script, r)) for r in (0, 1)]
    assert all(lines), [log_of(script, r)[-2000:] for r in (0, 1)]
    assert [m.group(2) for m in lines if m] == ["0", "0"]
    assert len({m.group(3) for m in lines if m}) == 1
    assert_nothing_left([task, script])
    gpu_watch.assert_free([task, script])


def _reported(job: JobView, rank: int) -> dict[str, str]:
    found = re.search(r"DEVICE (\S+) count=(\d+) visible='([^']*)' uuid=(\S+)", log_of(job, rank))
    assert found, log_of(job, rank)[-2000:]
    return dict(zip(("device", "count", "visible", "uuid"), found.groups(), strict=True))


async def test_each_rank_runs_on_the_physical_gpu_it_was_given(gpu_daemon: DaemonProc, gpu_watch: GpuWatch) -> None:
    """torch's device UUID is the UUID the daemon put in CUDA_VISIBLE_DEVICES and shows in `ddpctl daemon`."""
    d = gpu_daemon
    info = await d.client.daemon_info()
    nproc = min(2, len(info.gpu_devices))
    job = await d.run(d.spec(task="tests.gpu.tasks:report_device", nproc=nproc, steps=5, device="cuda",
                             gpus_per_rank=1, options={"require_cuda": True}))
    succeeded(job)
    uuids = [g.uuid for g in info.gpu_devices]
    for r in range(nproc):
        seen = _reported(job, r)
        assert seen["visible"] == seen["uuid"] and seen["uuid"] in uuids, (seen, uuids)
    assert len({_reported(job, r)["uuid"] for r in range(nproc)}) == nproc
    assert_nothing_left([job])
    gpu_watch.assert_free([job])


async def test_two_jobs_share_one_gpu_with_fractions(gpu_daemon: DaemonProc, gpu_watch: GpuWatch,
                                                     tmp_path: Path) -> None:
    """Two one-rank jobs of half a GPU each run at the same time on the same physical GPU."""
    d = gpu_daemon
    gate = tmp_path / "gate"
    ids = [await d.client.submit(gated(d, gate, gpus_per_rank=0.5, device="cuda")) for _ in range(2)]
    for job_id in ids:
        await wait_waiting_at_gate(d, job_id)  # both hold their CUDA context at once
    info = await d.client.daemon_info()
    shared = [g for g in info.gpu_devices if set(ids) <= set(g.jobs)]
    assert len(shared) == 1 and shared[0].held == 1.0, info.gpu_devices
    seen = [(await rank_reports(d.client, job_id))[0]["CUDA_VISIBLE_DEVICES"] for job_id in ids]
    assert seen == [shared[0].uuid] * 2
    gate.touch()
    with anyio.fail_after(120):
        done = [await d.client.wait(job_id) for job_id in ids]
    for job in done:
        succeeded(job)
    assert_nothing_left(done)
    gpu_watch.assert_free(done)


async def test_an_nccl_script_all_reduces_on_its_own_gpus(gpu_daemon: DaemonProc, gpu_watch: GpuWatch) -> None:
    d = gpu_daemon
    nproc = min(2, gpu_count())  # NCCL puts one rank on one GPU
    job = await d.run(d.spec(script=[str(REPO / "tests/gpu/nccl_script.py")], nproc=nproc, gpus_per_rank=1))
    succeeded(job)
    expected = nproc * (nproc + 1) / 2
    for r in range(nproc):
        found = re.search(r"NCCL done rank=(\d) device=(\d) sum=(\S+)", log_of(job, r))
        assert found and float(found.group(3)) == expected and found.group(2) == str(r), log_of(job, r)[-2000:]
    assert_nothing_left([job])
    gpu_watch.assert_free([job])


async def test_the_built_in_loop_never_syncs_the_host_within_a_step(gpu_daemon: DaemonProc,
                                                                   gpu_watch: GpuWatch) -> None:
    """torch.cuda.set_sync_debug_mode("error") over every step but DDP's first two: an implicit
    host-device sync (an .item(), a pageable copy) in the loop's step would fail the rank."""
    d = gpu_daemon
    job = await d.run(d.spec(task="tests.gpu.tasks:sync_checked", nproc=1, steps=200, device="cuda"))
    succeeded(job)
    assert "SYNC-CHECKED 198 steps" in log_of(job, 0)
    assert_nothing_left([job])
    gpu_watch.assert_free([job])


async def test_one_rank_nccl(gpu_daemon: DaemonProc, gpu_watch: GpuWatch) -> None:
    d = gpu_daemon
    job = await d.run(d.spec(task="tests.gpu.tasks:report_device", nproc=1, steps=50, device="cuda",
                             backend="nccl", options={"require_cuda": True}))
    succeeded(job)
    assert "DEVICE cuda:0 count=1" in log_of(job, 0)
    assert job.ranks[0].step == 50 and job.ranks[0].loss is not None and math.isfinite(job.ranks[0].loss)
    assert_nothing_left([job])
    gpu_watch.assert_free([job])


@needs_gpus(2)
async def test_two_rank_nccl_each_rank_its_own_gpu(gpu_daemon: DaemonProc, gpu_watch: GpuWatch) -> None:
    d = gpu_daemon
    job = await d.run(d.spec(task="tests.gpu.tasks:report_device", nproc=2, steps=50, device="cuda",
                             backend="nccl", options={"require_cuda": True}))
    succeeded(job)
    visible = [re.search(r"visible='([^']*)'", log_of(job, r)) for r in (0, 1)]
    assert all(visible)
    assert len({m.group(1) for m in visible if m}) == 2  # two different GPUs
    assert job.ranks[0].checksum == job.ranks[1].checksum is not None
    assert_nothing_left([job])
    gpu_watch.assert_free([job])


async def test_bf16_autocast_on_cuda(gpu_daemon: DaemonProc, gpu_watch: GpuWatch) -> None:
    d = gpu_daemon
    job = await d.run(d.spec(task="tests.gpu.tasks:bf16_probe", nproc=1, steps=20, device="cuda",
                             options={"bf16": True}))
    succeeded(job)
    assert "DTYPE torch.bfloat16 device=cuda:0" in log_of(job, 0)
    assert_nothing_left([job])
    gpu_watch.assert_free([job])


async def test_checkpoint_and_resume_on_cuda(gpu_daemon: DaemonProc, gpu_watch: GpuWatch) -> None:
    """A rank killed mid-run: the second attempt resumes from the CUDA checkpoint and ends where an
    uninterrupted run ends (within float tolerance: cuBLAS need not be bit-reproducible)."""
    d = gpu_daemon
    steps = 40
    reference = await d.run(d.spec(task="two-layer", nproc=1, steps=steps, device="cuda"))
    succeeded(reference)
    job_id = await d.client.submit(d.spec(task="tests.tasks:slow", nproc=1, steps=steps, device="cuda",
                                          max_restarts=1, checkpoint_every=5, options={"step_sleep": 0.1}))
    await d.wait_event(job_id, lambda e: e.kind == "job.checkpointed" and e.data["step"] >= 10)
    first = await d.client.status(job_id)
    victim = first.ranks[0].pid
    assert victim is not None
    os.kill(victim, signal.SIGKILL)
    with anyio.fail_after(180):
        job = await d.client.wait(job_id)
    succeeded(job)
    assert job.attempt == 2 and job.ranks[0].step == steps
    ref, got = reference.ranks[0].checksum, job.ranks[0].checksum
    assert ref is not None and got is not None and math.isclose(ref, got, rel_tol=1e-5, abs_tol=1e-6), (ref, got)
    assert_nothing_left([reference, first, job])
    gpu_watch.assert_free([reference, first, job])
