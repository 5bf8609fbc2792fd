"""A long history stays on disk: only unended and the most recent ended jobs are held in memory, the rest
is read from the journal when asked (status, pages, idempotency keys, counts)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from ddpd.daemon.config import Config
from ddpd.daemon.queue.facade import JobQueue, Jobs, LiveConfig
from ddpd.daemon.queue.resources import Resources
from ddpd.daemon.store.bus import EventBus
from ddpd.daemon.store.journal import Journal
from ddpd.daemon.store.state import StateDB
from ddpd.protocol import JobSpec, JobState

pytestmark = pytest.mark.anyio

SPEC = JobSpec(task="two-layer", nproc=1)


@pytest.fixture
async def queue(tmp_path: Path) -> AsyncIterator[JobQueue]:
    db = StateDB(tmp_path / "ddpd.db")
    config = LiveConfig(Config(state_dir=tmp_path, socket=tmp_path / "s"))
    yield JobQueue(config, Journal(db, EventBus()), Resources(0, 4), ended_held=2)  # two ended jobs in memory
    db.close()


async def held(jobs: Jobs, job_id: str) -> bool:
    """Whether the job is held in memory: found twice, it is one object (else each find reads a copy)."""
    first = await jobs.find(job_id, missing_ok=True)
    return first is not None and first is await jobs.find(job_id, missing_ok=True)


async def test_old_ended_jobs_leave_memory_not_the_record(queue: JobQueue) -> None:
    sched = queue.jobs
    ids = []
    for i in range(4):
        job = (await sched.submit(SPEC, 1000, f"k{i}")).job
        await sched.cancel(job, "test", force=False)
        ids.append(job.id)
    live = (await sched.submit(SPEC, 1000)).job
    assert [await held(sched, j) for j in [*ids, live.id]] == [False, False, True, True, True]
    old = await sched.find(ids[0], missing_ok=True)
    assert old is not None and old.state is JobState.CANCELLED and old.finished.is_set()
    done = await sched.submit(SPEC, 1000, "k0")  # its key still names it
    again, existed = done.job, done.existing
    assert existed and again.id == ids[0]
    page = await sched.page(3)
    assert [j.id for j in page] == [live.id, ids[3], ids[2]] and page[0] is live
    assert [j.id for j in await sched.page(10, page[-1].seq)] == [ids[1], ids[0]]
    assert [j.id for j in await sched.page(10, active=True)] == [live.id]
    counts = sched.overview().states
    assert (counts[JobState.CANCELLED], counts[JobState.QUEUED]) == (4, 1)
    await sched.remove(old, 1000)
    assert sched.overview().states[JobState.CANCELLED] == 3 and await sched.find(ids[0], missing_ok=True) is None


async def test_recovery_loads_only_the_recent_history(queue: JobQueue) -> None:
    ids = []
    for _ in range(4):
        job = (await queue.jobs.submit(SPEC, 1000)).job
        await queue.jobs.cancel(job, "test", force=False)
        ids.append(job.id)
    live = (await queue.jobs.submit(SPEC, 1000)).job
    fresh = JobQueue(queue.live, queue.journal, Resources(0, 4), ended_held=2)  # a restart
    await fresh.recover()
    assert [await held(fresh.jobs, j) for j in [*ids, live.id]] == [False, False, True, True, True]
    assert fresh.jobs.overview().states[JobState.CANCELLED] == 4
    job = (await fresh.jobs.submit(SPEC, 1000)).job
    assert job.seq == live.seq + 1
