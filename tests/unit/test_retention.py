"""Retention and `rm`: ended jobs are pruned when they expire (no polling), with their rows and files."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from ddpd.daemon.config import Config
from ddpd.daemon.layout import legacy_job_dir
from ddpd.daemon.queue.facade import JobQueue, Jobs, LiveConfig
from ddpd.daemon.queue.resources import Resources
from ddpd.daemon.store.bus import EventBus
from ddpd.daemon.store.errors import ForbiddenError, NotRunnableError
from ddpd.daemon.store.journal import Journal
from ddpd.daemon.store.state import StateDB
from ddpd.protocol import JobSpec, JobState

pytestmark = pytest.mark.anyio

SPEC = JobSpec(task="two-layer", nproc=1)


class Clock:
    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset


@pytest.fixture
async def setup(tmp_path: Path) -> AsyncIterator[tuple[JobQueue, Clock]]:
    db = StateDB(tmp_path / "ddpd.db")
    clock = Clock()
    config = Config(state_dir=tmp_path, socket=tmp_path / "s", retention=3600.0)
    yield JobQueue(LiveConfig(config), Journal(db, EventBus()), Resources(0, 4), clock=clock), clock
    db.close()


async def ended_job(sched: Jobs, state_dir: Path) -> str:
    job = (await sched.submit(SPEC, 1000, "key")).job
    legacy_job_dir(state_dir, job.id).mkdir(parents=True)
    (legacy_job_dir(state_dir, job.id) / "rank-0.log").write_text("log")
    await sched.cancel(job, "test", force=False)
    return job.id


async def test_expired_job_is_pruned_with_its_files(setup: tuple[JobQueue, Clock], tmp_path: Path) -> None:
    queue, clock = setup
    sched, journal = queue.jobs, queue.journal
    job_id = await ended_job(sched, tmp_path)
    kept = (await sched.submit(SPEC, 1000)).job  # not ended: never pruned
    await queue.shutdown(force=False)  # no worker in this test: the queue starts nothing
    events = journal.bus.subscribe()
    async with anyio.create_task_group() as tg:
        tg.start_soon(queue.run)
        clock.offset = 3600.5  # the first job's time has come (a reload makes the pruner look again)
        queue.reconfigure(queue.live.current)
        with anyio.fail_after(10):
            async for event in events:
                if event.kind == "job.pruned":
                    break
        tg.cancel_scope.cancel()
    assert event.data["pruned"] == job_id
    assert await sched.find(job_id, missing_ok=True) is None and not legacy_job_dir(tmp_path, job_id).exists()
    assert [j.id for j in await journal.load_jobs()] == [kept.id] and await sched.find(kept.id) is kept
    assert await journal.list_events(job_id, 0, 100) == []
    done = await sched.submit(SPEC, 1000, "key")  # the key went with the job
    again, existed = done.job, done.existing
    assert not existed and again.id != job_id


async def test_rm_by_owner_or_root_only_of_ended_jobs(setup: tuple[JobQueue, Clock], tmp_path: Path) -> None:
    sched = setup[0].jobs
    running = (await sched.submit(SPEC, 1000)).job
    with pytest.raises(NotRunnableError, match="QUEUED"):
        await sched.remove(running, 1000)
    job_id = await ended_job(sched, tmp_path)
    job = await sched.find(job_id)
    with pytest.raises(ForbiddenError, match="uid 1000"):
        await sched.remove(job, 1001)
    await sched.remove(job, 0)
    assert await sched.find(job_id, missing_ok=True) is None and not legacy_job_dir(tmp_path, job_id).exists()
    assert job.state is JobState.CANCELLED
