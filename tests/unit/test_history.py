"""A long history stays on disk: only unended and the most recent ended jobs are held in memory, the rest
is read from the journal when asked (status, pages, idempotency keys, counts)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from ddpd.daemon.config import Config
from ddpd.daemon.queue.facade import Jobs
from ddpd.daemon.queue.resources import Resources
from ddpd.daemon.store.bus import EventBus
from ddpd.daemon.store.journal import Journal
from ddpd.daemon.store.state import StateDB
from ddpd.protocol import JobSpec, JobState

pytestmark = pytest.mark.anyio

SPEC = JobSpec(task="two-layer", nproc=1)


@pytest.fixture
async def sched(tmp_path: Path) -> AsyncIterator[Jobs]:
    db = StateDB(tmp_path / "ddpd.db")
    s = Jobs(Config(state_dir=tmp_path, socket=tmp_path / "s"), Journal(db, EventBus()), Resources(0, 4))
    s.table.history = 2  # two ended jobs held in memory
    yield s
    db.close()


async def test_old_ended_jobs_leave_memory_not_the_record(sched: Jobs) -> None:
    ids = []
    for i in range(4):
        job = (await sched.submit(SPEC, 1000, f"k{i}")).job
        await sched.cancel(job, "test", force=False)
        ids.append(job.id)
    live = (await sched.submit(SPEC, 1000)).job
    assert set(sched.table.jobs) == {ids[2], ids[3], live.id}
    old = await sched.lookup(ids[0])
    assert old is not None and old.state is JobState.CANCELLED and old.finished.is_set()
    done = await sched.submit(SPEC, 1000, "k0")  # its key still names it
    again, existed = done.job, done.existing
    assert existed and again.id == ids[0]
    page = await sched.page(3)
    assert [j.id for j in page] == [live.id, ids[3], ids[2]] and page[0] is live
    assert [j.id for j in await sched.page(10, page[-1].seq)] == [ids[1], ids[0]]
    assert [j.id for j in await sched.page(10, active=True)] == [live.id]
    counts = sched.state_counts()
    assert (counts[JobState.CANCELLED], counts[JobState.QUEUED]) == (4, 1)
    await sched.remove(old, 1000)
    assert sched.state_counts()[JobState.CANCELLED] == 3 and await sched.lookup(ids[0]) is None


async def test_recovery_loads_only_the_recent_history(sched: Jobs) -> None:
    ids = []
    for _ in range(4):
        job = (await sched.submit(SPEC, 1000)).job
        await sched.cancel(job, "test", force=False)
        ids.append(job.id)
    live = (await sched.submit(SPEC, 1000)).job
    fresh = Jobs(sched.config, sched.journal, Resources(0, 4))
    fresh.table.history = 2
    await fresh.recover()
    assert set(fresh.table.jobs) == {ids[2], ids[3], live.id}
    assert fresh.state_counts()[JobState.CANCELLED] == 4
    job = (await fresh.submit(SPEC, 1000)).job
    assert job.seq == live.seq + 1
