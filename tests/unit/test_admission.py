"""Submission without workers: saved before published, idempotency keys, queue limits, configured bounds."""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from ddpd.daemon.config import Config
from ddpd.daemon.queue.facade import JobQueue, Jobs, LiveConfig
from ddpd.daemon.queue.resources import Resources
from ddpd.daemon.store.bus import EventBus
from ddpd.daemon.store.errors import LimitError, StorageError
from ddpd.daemon.store.journal import Journal
from ddpd.daemon.store.state import StateDB
from ddpd.protocol import JobSpec, JobState, SpecError
from ddpd.protocol.spec import Timeouts

pytestmark = pytest.mark.anyio


async def no_sleep(_: float) -> None:
    await anyio.lowlevel.checkpoint()


@pytest.fixture
async def queue(tmp_path: Path) -> AsyncIterator[JobQueue]:
    db = StateDB(tmp_path / "ddpd.db", busy_timeout=0.05)
    config = Config(state_dir=tmp_path, socket=tmp_path / "s", max_queued=3, max_queued_per_user=2,
                    priority_range=(-10, 10), max_kill_grace=30.0)
    yield JobQueue(LiveConfig(config), Journal(db, EventBus(), retries=(), sleep=no_sleep), Resources(0, 4))
    db.close()


@pytest.fixture
def sched(queue: JobQueue) -> Jobs:
    return queue.jobs


def held(jobs: Jobs) -> int:
    """Jobs on record (all queued here: none starts without `run`)."""
    return sum(jobs.overview().states.values())


SPEC = JobSpec(task="two-layer", nproc=1)


async def test_same_key_returns_the_same_job(sched: Jobs) -> None:
    done = await sched.submit(SPEC, 1000, "retry-1")
    job, existed = done.job, done.existing
    done = await sched.submit(SPEC, 1000, "retry-1")
    again, existed_again = done.job, done.existing
    done = await sched.submit(SPEC, 1001, "retry-1")  # keys are per owner
    other, other_existed = done.job, done.existing
    assert (existed, existed_again, other_existed) == (False, True, False)
    assert again is job and other is not job
    assert held(sched) == 2


async def test_concurrent_submits_with_one_key_make_one_job(sched: Jobs) -> None:
    results = []

    async def one() -> None:
        results.append(await sched.submit(SPEC, 1000, "k"))

    async with anyio.create_task_group() as tg:
        tg.start_soon(one)
        tg.start_soon(one)
    assert sorted(done.existing for done in results) == [False, True]
    assert results[0].job is results[1].job and held(sched) == 1


async def test_keys_survive_a_restart(queue: JobQueue, tmp_path: Path) -> None:
    job = (await queue.jobs.submit(SPEC, 1000, "k")).job
    fresh = JobQueue(queue.live, queue.journal, Resources(0, 4))  # a restart: the same config and database
    await fresh.recover()
    done = await fresh.jobs.submit(SPEC, 1000, "k")
    again, existed = done.job, done.existing
    assert existed and again.id == job.id


async def test_queue_limits_per_user_and_in_all(sched: Jobs) -> None:
    first = (await sched.submit(SPEC, 1000)).job
    await sched.submit(SPEC, 1000)
    with pytest.raises(LimitError, match="max_queued_per_user"):
        await sched.submit(SPEC, 1000)
    await sched.submit(SPEC, 1001)
    with pytest.raises(LimitError, match="max_queued"):
        await sched.submit(SPEC, 1002)
    await sched.cancel(first, "test", force=False)  # an ended job no longer counts
    await sched.submit(SPEC, 1002)


@pytest.mark.parametrize(("spec", "field"), [
    (JobSpec(task="two-layer", nproc=1, priority=11), "priority"),
    (JobSpec(task="two-layer", nproc=1, priority=-11), "priority"),
    (JobSpec(task="two-layer", nproc=1, timeouts=Timeouts(kill_grace=31.0)), "timeouts.kill_grace"),
    (JobSpec(task="two-layer", nproc=5), "nproc"),
])
async def test_bounds_name_the_field(sched: Jobs, spec: JobSpec, field: str) -> None:
    with pytest.raises(SpecError) as info:
        await sched.submit(spec, 1000)
    assert info.value.field == field
    assert held(sched) == 0


async def test_bad_key_is_refused(sched: Jobs) -> None:
    with pytest.raises(SpecError, match="idempotency_key"):
        await sched.submit(SPEC, 1000, "x" * 201)


async def test_a_job_that_cannot_be_saved_leaves_no_trace(sched: Jobs, tmp_path: Path) -> None:
    """Bug: a failed write answered an error, yet the job stayed queued in memory and later ran."""
    holder = sqlite3.connect(tmp_path / "ddpd.db", isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(StorageError):
            await sched.submit(SPEC, 1000, "k")
    finally:
        holder.rollback()
        holder.close()
    now = sched.overview(order=True)
    assert sum(now.states.values()) == 0 and (now.active, now.queued) == (0, 0) and now.positions == {}
    done = await sched.submit(SPEC, 1000, "k")  # the retry is a new job, saved
    job, existed = done.job, done.existing
    assert not existed and job.state is JobState.QUEUED
