"""CUDA training through the daemon: the seed program, NCCL with one and two ranks, bf16, resume."""

from __future__ import annotations

import math
import os
import re
import signal

import anyio
import pytest

from ddpd.protocol import JobState
from ddpd.protocol.control import JobView

from ..conftest import REPO, DaemonProc, assert_nothing_left
from .conftest import GpuWatch, log_of, needs_gpus

pytestmark = pytest.mark.anyio


def succeeded(job: JobView) -> None:
    assert job.state == JobState.SUCCEEDED, (job.reason, job.root_cause, [log_of(job, r.rank)[-3000:]
                                                                           for r in job.ranks])


async def test_seed_program_gloo_with_cuda_tensors_two_ranks_share_gpu0(gpu_daemon: DaemonProc,
                                                                         gpu_watch: GpuWatch) -> None:
    """The classic program both ways: as the built-in two-layer task (gloo, device auto) and as an
    unmodified script; two ranks on GPU 0, equal parameters on both ranks."""
    d = gpu_daemon
    share = {"CUDA_VISIBLE_DEVICES": "0"}
    task = await d.run(d.spec(task="tests.gpu.tasks:report_device", nproc=2, steps=20, backend="gloo",
                              env=share, options={"require_cuda": True}))
    succeeded(task)
    for r in (0, 1):
        assert "DEVICE cuda:0 count=1" in log_of(task, r)
    assert task.ranks[0].checksum == task.ranks[1].checksum is not None

    script = await d.run(d.spec(script=[str(REPO / "tests/gpu/seed_script.py")], nproc=2, env=share))
    succeeded(script)
    lines = [re.search(r"SEED done rank=(\d) device=(\d) checksum=(\S+)", log_of(script, r)) for r in (0, 1)]
    assert all(lines), [log_of(script, r)[-2000:] for r in (0, 1)]
    assert [m.group(2) for m in lines if m] == ["0", "0"]
    assert len({m.group(3) for m in lines if m}) == 1
    assert_nothing_left([task, script])
    gpu_watch.assert_free([task, script])


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
