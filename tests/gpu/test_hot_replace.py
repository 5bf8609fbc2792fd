"""Hot rank replacement on GPUs: the state travels as a CUDA tensor; under NCCL the survivors abort
their communicator on the daemon's Reform (NCCL does not notice a dead peer by itself)."""

from __future__ import annotations

import anyio
import pytest

from ddpd.protocol import JobState
from ddpd.protocol.control import JobView

from ..conftest import DaemonProc, assert_gone, assert_nothing_left
from ..integration.test_hot_replace import STEP_SLEEP, checksums, events_of, kill_rank
from .conftest import GpuWatch, needs_gpus

pytestmark = pytest.mark.anyio


async def _replaced_run(d: DaemonProc, nproc: int, **spec: object) -> tuple[JobView, JobView, int]:
    job_spec = d.spec(task="tests.tasks:slow", nproc=nproc, steps=300, seed=5, options={"step_sleep": STEP_SLEEP},
                      **spec)
    reference = await d.run(job_spec)
    assert reference.state == JobState.SUCCEEDED, reference.root_cause
    job_id = await d.client.submit(job_spec)
    victim, survivors = await kill_rank(d, job_id, 1, after_step=60)
    with anyio.fail_after(120):
        job = await d.client.wait(job_id)
    assert job.state == JobState.SUCCEEDED and job.attempt == 1, job.root_cause
    assert {r.rank: r.pid for r in job.ranks if r.rank != 1} == survivors
    assert [e.kind for e in await events_of(d, job_id)].count("rank.replaced") == 1
    assert_gone(victim)
    return reference, job, victim


async def test_two_ranks_on_one_gpu_under_gloo_replace_a_lost_rank(gpu_daemon: DaemonProc,
                                                                   gpu_watch: GpuWatch) -> None:
    reference, job, _ = await _replaced_run(gpu_daemon, 2, backend="gloo", gpus_per_rank=0.5)
    assert checksums(job) == checksums(reference)
    assert_nothing_left([reference, job])
    gpu_watch.assert_free([reference, job])


@needs_gpus(2)
async def test_nccl_survivors_abort_their_communicator_and_re_form(gpu_daemon: DaemonProc,
                                                                   gpu_watch: GpuWatch) -> None:
    reference, job, _ = await _replaced_run(gpu_daemon, 2, backend="nccl", gpus_per_rank=1)
    # NCCL's reductions may order sums differently across communicators: equal within rounding
    assert len(checksums(job)) == 1
    (ref,), (got,) = checksums(reference), checksums(job)
    assert ref is not None and got is not None and abs(ref - got) <= 1e-5 * max(1.0, abs(ref))
    assert_nothing_left([reference, job])
    gpu_watch.assert_free([reference, job])
