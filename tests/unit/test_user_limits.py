"""The per-user GPU limit (max_gpus_per_user): refused at submit when a job alone exceeds it; held in
the queue, letting other users' jobs pass, while its owner's running jobs hold too many."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddpd.daemon.config import Config
from ddpd.daemon.queue.admission import admit, over_user_gpus
from ddpd.daemon.queue.resources import Resources
from ddpd.daemon.store.records import Job
from ddpd.protocol import JobSpec, JobState, SpecError

pytestmark = pytest.mark.anyio


def job(uid: int, gpus_per_rank: int, nproc: int = 1, held: int = 0) -> Job:
    device = "cuda" if gpus_per_rank else "cpu"
    spec = JobSpec(task="two-layer", nproc=nproc, gpus_per_rank=gpus_per_rank, device=device)
    return Job(id=f"j-{uid}-{gpus_per_rank}-{held}", seq=1, name="x", owner_uid=uid, spec=spec,
               state=JobState.RUNNING if held else JobState.QUEUED, submitted_at=0.0, gpus=list(range(held)))


def test_no_limit_by_default() -> None:
    assert not over_user_gpus(Config(), [job(1000, 1, held=8)], job(1000, 1, nproc=8))


def test_a_users_running_gpus_hold_only_their_own_next_job() -> None:
    config = Config(max_gpus_per_user=4)
    running = [job(1000, 1, nproc=3, held=3), job(2000, 1, held=1)]
    assert over_user_gpus(config, running, job(1000, 1, nproc=2))  # 3 + 2 > 4
    assert not over_user_gpus(config, running, job(1000, 1, nproc=1))  # 3 + 1 = 4
    assert not over_user_gpus(config, running, job(2000, 1, nproc=3))  # another user's: 1 + 3
    assert not over_user_gpus(config, running, job(1000, 0, nproc=8))  # a CPU job holds no GPU


async def test_a_job_larger_than_the_limit_is_refused_at_submit(tmp_path: Path) -> None:
    config = Config(state_dir=tmp_path, max_gpus_per_user=2)
    with pytest.raises(SpecError) as err:
        await admit(JobSpec(task="two-layer", nproc=3, device="cuda", gpus_per_rank=1), config, Resources(8, 4))
    assert err.value.field == "gpus_per_rank" and "max_gpus_per_user" in str(err.value)
    await admit(JobSpec(task="two-layer", nproc=2, device="cuda", gpus_per_rank=1), config, Resources(8, 4))
