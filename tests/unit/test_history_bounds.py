"""Each user's history within its bounds (issue 34, finding 6): the oldest of that user's ended jobs are
retired (rows, events, files), never another user's, never the newest or one a queued job waits for;
a submit at the bound is told so, and one past it (a backlog) retires before the new job is saved."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from ddpd.daemon.config import Config, ConfigError, load_config
from ddpd.daemon.queue import history
from ddpd.daemon.queue.facade import JobQueue, Jobs, LiveConfig
from ddpd.daemon.queue.resources import Resources
from ddpd.daemon.queue.retention import beyond_bounds, past_bounds
from ddpd.daemon.store.bus import EventBus
from ddpd.daemon.store.journal import Journal
from ddpd.daemon.store.state import StateDB
from ddpd.protocol import JobSpec, JobState

pytestmark = pytest.mark.anyio

SPEC = JobSpec(task="two-layer", nproc=1)
ANN, BOB = 1000, 1001


def test_past_bounds_takes_the_oldest_first_and_never_the_newest() -> None:
    held = [("a", 10), ("b", 10), ("c", 10), ("d", 10)]
    assert past_bounds(held, 2, 0, set()) == ["a", "b"]
    assert past_bounds(held, 0, 25, set()) == ["a", "b"]
    assert past_bounds(held, 3, 15, set()) == ["a", "b", "c"]  # bytes: down to the newest alone
    assert past_bounds(held, 2, 0, {"a"}) == ["b", "c"]  # one a queued job waits for stays (and counts)
    assert past_bounds([("big", 100)], 0, 10, set()) == []  # the newest stays, whatever it weighs
    assert past_bounds(held, 0, 0, set()) == [] and past_bounds(held, 4, 40, set()) == []
    assert not beyond_bounds(4, 40, 4, 0) and beyond_bounds(5, 0, 4, 0) and beyond_bounds(1, 41, 0, 40)
    assert not beyond_bounds(4, 40, 4, 40) and not beyond_bounds(10**6, 10**9, 0, 0)


def test_the_bounds_are_config_keys_with_ranges(tmp_path: Path) -> None:
    cfg = Config()
    assert (cfg.max_history_per_user, cfg.max_history_bytes_per_user) == (1000, 64 * 1024 * 1024)
    path = tmp_path / "ddpd.toml"
    path.write_text("max_history_per_user = 5\nmax_history_bytes_per_user = 0\n")
    assert (load_config(path).max_history_per_user, load_config(path).max_history_bytes_per_user) == (5, 0)
    path.write_text("max_history_per_user = -1\n")
    with pytest.raises(ConfigError, match="max_history_per_user"):
        load_config(path)


@pytest.fixture
async def queue(tmp_path: Path) -> AsyncIterator[JobQueue]:
    db = StateDB(tmp_path / "ddpd.db")
    config = Config(state_dir=tmp_path, socket=tmp_path / "s", max_history_per_user=3)
    q = JobQueue(LiveConfig(config), Journal(db, EventBus()), Resources(0, 4))
    await q.shutdown(force=False)  # no worker here: the queue starts nothing (its other tasks run)
    yield q
    db.close()


async def ended(sched: Jobs, uid: int, **kw: object) -> str:
    job = (await sched.submit(JobSpec(task="two-layer", nproc=1, **kw), uid)).job  # type: ignore[arg-type]
    await sched.cancel(job, "test", force=False)  # a cancelled job counts as any ended one
    return job.id


async def test_a_users_oldest_ended_jobs_are_retired_never_another_users(queue: JobQueue) -> None:
    sched, journal = queue.jobs, queue.journal
    bobs = [await ended(sched, BOB) for _ in range(3)]
    events = journal.bus.subscribe()
    async with anyio.create_task_group() as tg:
        tg.start_soon(queue.run)
        anns = [await ended(sched, ANN) for _ in range(5)]
        with anyio.fail_after(10):  # each end of hers wakes the retention task: her fifth one's retirement
            async for event in events:
                if event.kind == "job.history_retired" and anns[1] in event.data["retired"]:
                    break
        tg.cancel_scope.cancel()
    assert [j for j, _ in await journal.history_of(ANN)] == anns[-3:]
    assert [j for j, _ in await journal.history_of(BOB)] == bobs
    for gone in anns[:2]:
        assert await sched.find(gone, missing_ok=True) is None and await journal.list_events(gone, 0, 10) == []
    assert sched.overview().states[JobState.CANCELLED] == 6
    retired = [e for e in await journal.list_events(None, 0, 1000) if e.kind == "job.history_retired"]
    assert retired and all(e.job_id in anns for e in retired)  # recorded on her own kept job, nowhere else
    assert not [e for e in await journal.list_events(None, 0, 1000) if e.job_id is None]


async def test_a_submit_at_the_bound_is_told_and_one_past_it_retires_first(queue: JobQueue) -> None:
    sched, journal = queue.jobs, queue.journal
    first = await sched.submit(SPEC, ANN)
    assert first.notices == []
    await sched.cancel(first.job, "test", force=False)
    ids = [first.job.id]
    for _ in range(3):  # no retention task runs here: her ends are retired only by her submits
        ids.append(await ended(sched, ANN))
    assert [j for j, _ in await journal.history_of(ANN)] == ids  # past the bound (3) by one
    done = await sched.submit(SPEC, ANN)
    assert len(done.notices) == 1, done.notices
    notice = done.notices[0]
    assert "your history is at its bound: 3 ended jobs kept" in notice and "max_history_per_user = 3" in notice
    assert notice.endswith(f"retired now: {ids[0]}"), notice
    assert [j for j, _ in await journal.history_of(ANN)] == ids[1:]
    assert (await sched.submit(SPEC, BOB)).notices == []


async def test_bytes_bound_and_a_job_a_queued_one_waits_for(tmp_path: Path) -> None:
    db = StateDB(tmp_path / "ddpd.db")
    config = Config(state_dir=tmp_path, socket=tmp_path / "s", max_history_per_user=0,
                    max_history_bytes_per_user=3 * 2200)
    journal = Journal(db, EventBus())
    sched = JobQueue(LiveConfig(config), journal, Resources(0, 4)).jobs  # never run: nothing starts
    try:
        big = {"environ": {"PAD": "x" * 1500}}
        kept = await ended(sched, ANN, **big)
        waiting = (await sched.submit(JobSpec(task="two-layer", nproc=1, after_any=[kept]), ANN)).job
        others = [await ended(sched, ANN, **big) for _ in range(4)]
        sizes = dict(await journal.history_of(ANN))
        assert all(1500 < size <= 2200 for size in sizes.values()), sizes  # the padded environment, counted
        done = await sched.submit(SPEC, ANN)
        left = await journal.history_of(ANN)
        assert [j for j, _ in left] == [kept, others[-2], others[-1]]  # the one waited for stays, and counts
        assert sum(size for _, size in left) <= 3 * 2200 and "max_history_bytes_per_user = 6.45 KiB" in done.notices[0]
        assert waiting.state is JobState.QUEUED
    finally:
        db.close()


async def test_a_long_backlog_is_retired_a_batch_at_a_time(queue: JobQueue, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A bound lowered (or a daemon upgraded) over a long history: a submit waits for one batch only,
    the retention task takes the rest."""
    sched, journal = queue.jobs, queue.journal
    queue.reconfigure(Config(state_dir=tmp_path, socket=tmp_path / "s", max_history_per_user=0))
    ids = [await ended(sched, ANN) for _ in range(7)]
    queue.reconfigure(Config(state_dir=tmp_path, socket=tmp_path / "s", max_history_per_user=1))
    monkeypatch.setattr(history, "RETIRE_BATCH", 2)
    done = await sched.submit(SPEC, ANN)
    assert done.notices[0].endswith(f"retired now: {ids[0]}, {ids[1]}"), done.notices
    assert [j for j, _ in await journal.history_of(ANN)] == ids[2:]
    events = journal.bus.subscribe()
    async with anyio.create_task_group() as tg:
        tg.start_soon(queue.run)
        with anyio.fail_after(10):
            async for event in events:
                if event.kind == "job.history_retired" and ids[5] in event.data["retired"]:
                    break
        tg.cancel_scope.cancel()
    assert [j for j, _ in await journal.history_of(ANN)] == ids[6:]


async def test_the_ended_jobs_of_an_older_database_are_counted_once_at_the_upgrade(tmp_path: Path) -> None:
    db = StateDB(tmp_path / "ddpd.db")
    sched = JobQueue(LiveConfig(Config(state_dir=tmp_path, socket=tmp_path / "s")), Journal(db, EventBus()),
                     Resources(0, 4)).jobs
    job_id = await ended(sched, ANN, environ={"PAD": "y" * 3000})
    db.run_sync(lambda c: c.execute("ALTER TABLE jobs DROP COLUMN stored_bytes"))  # as schema 6 had it
    db.close()
    again = StateDB(tmp_path / "ddpd.db")
    try:
        (size,) = again.run_sync(lambda c: c.execute("SELECT stored_bytes FROM jobs WHERE id = ?",
                                                     (job_id,)).fetchone())
        assert 3000 < size < 6000, size  # its spec and its events (submitted, cancelled, finished)
    finally:
        again.close()
