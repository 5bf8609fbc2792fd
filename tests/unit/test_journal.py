"""The journal against a real SQLite file: round trips, migration, durability settings, and storage
trouble (a lock held by another connection, an unusable state directory) that never raises into
supervision and never leaves a half-made job."""

from __future__ import annotations

import functools
import os
import sqlite3
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import anyio
import pytest
from structlog.testing import capture_logs

from ddpd.daemon.store.bus import EventBus
from ddpd.daemon.store.errors import StorageError
from ddpd.daemon.store.journal import Journal
from ddpd.daemon.store.records import Job, Rank
from ddpd.daemon.store.state import SCHEMA_VERSION, StateDB
from ddpd.protocol import JobSpec, JobState, RankState
from ddpd.protocol.nodes import NodeView

pytestmark = pytest.mark.anyio


async def no_sleep(_: float) -> None:
    await anyio.lowlevel.checkpoint()


@pytest.fixture
def db(tmp_path: Path) -> Iterator[StateDB]:
    state = StateDB(tmp_path / "ddpd.db", busy_timeout=0.05)
    yield state
    state.close()


@pytest.fixture
def journal(db: StateDB) -> Journal:
    return Journal(db, EventBus(), retries=(0.0, 0.0), sleep=no_sleep)


def make_job(seq: int = 1, key: str | None = None, owner: int = 1000) -> Job:
    return Job(id=f"j{seq}-abcd", seq=seq, name="t", owner_uid=owner, spec=JobSpec(task="two-layer", nproc=2),
               state=JobState.QUEUED, submitted_at=time.time(), idempotency_key=key)


def locked(path: Path) -> sqlite3.Connection:
    """Another process's view: a connection holding the database with BEGIN EXCLUSIVE."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("BEGIN EXCLUSIVE")
    return conn


async def test_jobs_ranks_attempts_and_events_round_trip(journal: Journal) -> None:
    job = make_job(key="k1")
    await journal.create_job(job)
    job.attempt = 1
    await journal.job_state(job, JobState.STARTING, "attempt 1")
    rank = Rank(rank=0, attempt=1, pid=123, pgid=123)
    await journal.save_rank(job, rank)
    await journal.rank_state(job, rank, RankState.CONNECTED, "rank.connected")
    await journal.save_attempt(job, 1, pgid=123, store_port=5555, token="tok")
    await journal.event(None, "daemon.note", detail="x")

    [loaded] = await journal.load_jobs()
    assert (loaded.id, loaded.state, loaded.idempotency_key, loaded.spec) == (job.id, JobState.STARTING, "k1",
                                                                             job.spec)
    [again] = await journal.load_jobs(recent_ended=0)
    assert [(r.pid, r.state) for r in again.ranks] == [(123, RankState.CONNECTED)]
    assert (await journal.load_job(job.id)) is not None and await journal.load_job("nope") is None
    assert await journal.attempt_tokens(job.id, 1) == ["tok"]
    everything = await journal.list_events(None, 0, 100)
    mine = await journal.list_events(job.id, 0, 100)
    assert [e.kind for e in mine] == ["job.state_changed", "rank.connected"]
    assert len(everything) == 3
    assert [e.seq for e in await journal.list_events(None, mine[0].seq, 1)] == [mine[1].seq]


async def test_a_stored_spec_beyond_todays_bounds_fails_its_job_instead_of_stopping_recovery(
        journal: Journal, db: StateDB) -> None:
    """Bug guard: a row saved before the spec had bounds (a 700 KB name) stopped recovery on every start."""
    queued, ended = make_job(1), make_job(2)
    await journal.create_job(queued)
    await journal.create_job(ended)
    await journal.job_state(ended, JobState.CANCELLED, "by test")
    big = '{"name": "' + "x" * 700_000 + '", "nproc": 2}'
    await db.run(lambda conn: conn.execute("UPDATE jobs SET spec = ?", (big,)))
    loaded = {j.id: j for j in await journal.load_jobs()}
    assert loaded[queued.id].state is JobState.FAILED and loaded[queued.id].reason == "spec_unreadable"
    assert loaded[queued.id].root_cause is not None and "bounds" in (loaded[queued.id].root_cause.detail or "")
    assert loaded[ended.id].state is JobState.CANCELLED  # an ended job keeps its state


async def test_a_multi_node_jobs_node_table_and_each_attempts_ranks_are_kept(journal: Journal, db: StateDB) -> None:
    """The node table as the job ended (issue 38: `status` after a restart) and the global ranks each
    attempt started here (what `logs --attempt N` reads); a table that no longer decodes is none."""
    job = make_job()
    await journal.create_job(job)
    job.nodes = [NodeView(node_rank=0, host="10.0.0.1", daemon="a:1", state="succeeded", ranks=[0, 1]),
                 NodeView(node_rank=1, host="10.0.0.2", daemon="b:2", state="unknown", ranks=[2, 3], local=True)]
    job.attempt = 2
    await journal.save_job(job)
    for attempt, ranks in ((1, (0, 1)), (2, (2, 3))):
        for r in ranks:
            await journal.save_rank(job, Rank(rank=r, attempt=attempt))
    loaded = await journal.load_job(job.id)
    assert loaded is not None and loaded.nodes == job.nodes
    assert [r.rank for r in loaded.ranks] == [2, 3]
    assert await journal.attempt_ranks(job.id, 1) == [0, 1] and await journal.attempt_ranks(job.id, 3) == []
    db.run_sync(lambda c: c.execute("UPDATE jobs SET nodes = '[{\"node_rank\": -1}]'"))
    loaded = await journal.load_job(job.id)
    assert loaded is not None and loaded.nodes == []


async def test_delete_job_removes_every_row(journal: Journal, db: StateDB) -> None:
    job = make_job()
    await journal.create_job(job)
    await journal.save_rank(job, Rank(rank=0, attempt=1))
    await journal.save_attempt(job, 1, pgid=None, store_port=None, token="t")
    await journal.event(job, "job.note")
    await journal.delete_job(job.id)
    for table in ("jobs", "ranks", "attempts", "events"):
        assert db.run_sync(lambda c, t=table: c.execute(f"SELECT count(*) FROM {t}").fetchone()[0]) == 0


def test_durable_and_patient_by_default(tmp_path: Path) -> None:
    db = StateDB(tmp_path / "ddpd.db")
    try:
        assert db.run_sync(lambda c: c.execute("PRAGMA synchronous").fetchone()[0]) == 2  # FULL
        assert db.run_sync(lambda c: c.execute("PRAGMA busy_timeout").fetchone()[0]) >= 1000
        assert db.run_sync(lambda c: c.execute("PRAGMA journal_mode").fetchone()[0]) == "wal"
    finally:
        db.close()


def test_migration_adds_the_idempotency_key(tmp_path: Path) -> None:
    path = tmp_path / "ddpd.db"
    old = sqlite3.connect(path)
    old.execute("CREATE TABLE jobs (id TEXT PRIMARY KEY, seq INTEGER NOT NULL, name TEXT NOT NULL, owner_uid "
                "INTEGER NOT NULL, spec TEXT NOT NULL, state TEXT NOT NULL, attempt INTEGER NOT NULL DEFAULT 0, "
                "priority INTEGER NOT NULL DEFAULT 0, submitted_at REAL NOT NULL, started_at REAL, "
                "finished_at REAL, reason TEXT, root_cause TEXT)")
    old.commit()
    old.close()
    db = StateDB(path)
    try:
        cols = {r[1] for r in db.run_sync(lambda c: c.execute("PRAGMA table_info(jobs)").fetchall())}
        assert "idempotency_key" in cols and "nodes" in cols
        indexes = {r[1] for r in db.run_sync(lambda c: c.execute("PRAGMA index_list(jobs)").fetchall())}
        assert "jobs_idempotency" in indexes
    finally:
        db.close()


def test_migration_drops_the_attempt_columns_nothing_wrote(tmp_path: Path) -> None:
    path = tmp_path / "ddpd.db"
    old = sqlite3.connect(path)
    old.execute("CREATE TABLE attempts (job_id TEXT NOT NULL, attempt INTEGER NOT NULL, pgid INTEGER, "
                "store_port INTEGER, token TEXT NOT NULL, started_at REAL NOT NULL, ended_at REAL, root_cause TEXT, "
                "PRIMARY KEY (job_id, attempt))")
    old.execute("INSERT INTO attempts (job_id, attempt, pgid, token, started_at) VALUES ('j1-abcd', 1, 42, 't', 1.5)")
    old.execute("CREATE TABLE ranks (job_id TEXT NOT NULL, attempt INTEGER NOT NULL, rank INTEGER NOT NULL, "
                "state TEXT NOT NULL, pid INTEGER, pgid INTEGER, step INTEGER NOT NULL DEFAULT 0, loss REAL, "
                "exit_code INTEGER, signal TEXT, checksum REAL, log TEXT, stack_dump INTEGER NOT NULL DEFAULT 0, "
                "PRIMARY KEY (job_id, attempt, rank))")
    old.execute("INSERT INTO ranks (job_id, attempt, rank, state) VALUES ('j1-abcd', 1, 0, 'EXITED')")
    old.execute("PRAGMA user_version=2")
    old.commit()
    old.close()
    db = StateDB(path)
    try:
        cols = [r[1] for r in db.run_sync(lambda c: c.execute("PRAGMA table_info(attempts)").fetchall())]
        assert cols == ["job_id", "attempt", "pgid", "store_port", "token", "started_at", "cgroup"]
        rows = db.run_sync(lambda c: c.execute("SELECT job_id, attempt, pgid, token FROM attempts").fetchall())
        assert [tuple(r) for r in rows] == [("j1-abcd", 1, 42, "t")]
        assert db.run_sync(lambda c: c.execute("PRAGMA user_version").fetchone()[0]) == SCHEMA_VERSION == 7
        assert db.run_sync(lambda c: c.execute("SELECT count(*) FROM usage").fetchone()[0]) == 0  # added, empty
        # hot replacement's count per rank: added, 0 for the ranks already recorded
        assert db.run_sync(lambda c: c.execute("SELECT replacements FROM ranks").fetchall()[0][0]) == 0
    finally:
        db.close()
    again = StateDB(path)  # a second start finds nothing to do
    again.close()


async def test_same_key_same_owner_is_one_row(journal: Journal) -> None:
    await journal.create_job(make_job(1, key="k"))
    await journal.create_job(make_job(2, key="k", owner=1001))  # another owner may use the same key
    with pytest.raises(StorageError):
        await journal.create_job(make_job(3, key="k"))


async def test_locked_database_refuses_a_new_job(journal: Journal, db: StateDB) -> None:
    """Bug: a submit that failed with `database is locked` still ran its job (a ghost)."""
    holder = locked(db.path)
    try:
        with pytest.raises(StorageError, match="could not be saved"):
            await journal.create_job(make_job())
    finally:
        holder.rollback()
        holder.close()
    assert await journal.load_jobs() == []


async def test_supervision_writes_degrade_instead_of_raising(journal: Journal, db: StateDB) -> None:
    job = make_job()
    await journal.create_job(job)
    followed = journal.bus.subscribe()
    holder = locked(db.path)
    try:
        with capture_logs() as logs:
            await journal.job_state(job, JobState.CANCELLED, "cancelled")  # must not raise
            await journal.event(job, "job.note")  # a second write while storage is down
    finally:
        holder.rollback()
        holder.close()
    assert job.state is JobState.CANCELLED and job.finished.is_set()
    failed = [e for e in logs if e["event"] == "journal.write_failed"]
    retries = [e for e in logs if e["event"] == "journal.write_retry"]
    assert failed and failed[0]["log_level"] == "error" and "locked" in failed[0]["error"]
    # the first write (the job's row and its event, one write) was tried three times (two pauses), the
    # next one once: storage is known to be down
    assert (len(failed), len(retries)) == (2, 2)
    assert journal.failed_writes == len(failed)
    kinds = []
    while True:
        try:
            kinds.append(followed.receive_nowait().kind)
        except anyio.WouldBlock:
            break
    assert "journal.write_failed" in kinds and "job.state_changed" in kinds  # followers still see it
    # the lock is gone: writes work again
    await journal.save_job(job)
    [loaded] = await journal.load_jobs()
    assert loaded.state is JobState.CANCELLED


async def test_after_a_write_was_given_up_the_next_are_tried_once(journal: Journal, db: StateDB) -> None:
    job = make_job()
    await journal.create_job(job)
    holder = locked(db.path)
    try:
        await journal.event(job, "first")  # tried three times, then given up
        with capture_logs() as logs:
            await journal.event(job, "second")
            await journal.event(job, "third")
    finally:
        holder.rollback()
        holder.close()
    assert [e["event"] for e in logs if e["event"].startswith("journal.")] == ["journal.write_failed"] * 2
    await journal.event(job, "fourth")  # storage is back
    assert [e.kind for e in await journal.list_events(job.id, 0, 10)] == ["fourth"]


def test_state_dir_that_is_a_file(tmp_path: Path) -> None:
    where = tmp_path / "state"
    where.write_text("not a directory")
    with pytest.raises(StorageError, match=f"state directory {where}: exists and is not a directory"):
        StateDB.open_dir(where)


def test_corrupt_database(tmp_path: Path) -> None:
    (tmp_path / "ddpd.db").write_bytes(b"garbage " * 1000)
    with pytest.raises(StorageError, match=f"state database {tmp_path / 'ddpd.db'}: file is not a database"):
        StateDB.open_dir(tmp_path)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through permission bits")
def test_unwritable_state_dir(tmp_path: Path) -> None:
    where = tmp_path / "state"
    where.mkdir(mode=0o500)
    with pytest.raises(StorageError, match=str(where)):
        StateDB.open_dir(where)


async def test_concurrent_writes_share_transactions_and_each_returns_once_on_disk(journal: Journal,
                                                                                   db: StateDB) -> None:
    job = make_job()
    await journal.create_job(job)
    before = journal.batches
    seqs: dict[int, int] = {}

    async def one(i: int) -> None:
        await journal.event(job, "rank.spawned", rank=i)
        seqs[i] = len(await journal.list_events(job.id, 0, 1000))  # on disk when the call returns

    async with anyio.create_task_group() as tg:
        for i in range(200):
            tg.start_soon(one, i)
    events = await journal.list_events(job.id, 0, 1000)
    assert sorted(e.rank for e in events if e.rank is not None) == list(range(200))
    assert all(seqs[i] >= 1 for i in range(200))
    assert journal.batches - before < 50  # group commit: far fewer transactions than writes


async def test_a_bad_write_in_a_batch_fails_alone(journal: Journal) -> None:
    job = make_job()
    await journal.create_job(job)

    def bug(_: sqlite3.Connection) -> None:
        raise TypeError("a bug in a write")

    async def bad() -> None:
        with pytest.raises(TypeError, match="a bug"):
            await journal._write("bad", bug)

    async with anyio.create_task_group() as tg:
        for i in range(20):
            tg.start_soon(functools.partial(journal.event, job, "ok", rank=i))
        tg.start_soon(bad)
        for i in range(20, 40):
            tg.start_soon(functools.partial(journal.event, job, "ok", rank=i))
    assert len(await journal.list_events(job.id, 0, 100)) == 40 and journal.failed_writes == 0


async def test_a_writer_cancelled_while_committing_leaves_the_others_writes_to_the_next(db: StateDB) -> None:
    paused = anyio.Event()

    async def pause(_: float) -> None:
        paused.set()
        await anyio.sleep_forever()

    pauses: list[Callable[[float], Awaitable[None]]] = [pause]  # the first retry's pause, then none

    async def sleep(seconds: float) -> None:
        await pauses[-1](seconds)

    journal = Journal(db, EventBus(), retries=(0.0, 0.0), sleep=sleep)
    job = make_job()
    await journal.create_job(job)
    holder = locked(db.path)  # the first write fails and pauses before its retry: there it is cancelled
    leader = anyio.CancelScope()

    async def first() -> None:
        with leader:
            await journal.event(job, "first")

    async with anyio.create_task_group() as tg:
        tg.start_soon(first)
        with anyio.fail_after(10):
            await paused.wait()
        tg.start_soon(functools.partial(journal.event, job, "second"))  # queued behind the batch under way
        await anyio.wait_all_tasks_blocked()
        pauses.append(no_sleep)
        holder.rollback()
        holder.close()
        leader.cancel()  # the second writer takes over: its write and the cancelled one go in
    assert [e.kind for e in await journal.list_events(job.id, 0, 10)] == ["first", "second"]


async def test_events_reach_followers_in_stamp_order_live_ones_too(db: StateDB) -> None:
    """Bug: a live (never stored) progress event made while a stored one was being committed was
    published first: a follower saw stamps go back. Now each waits for the ones stamped before it."""
    journal = Journal(db, EventBus(), retries=(0.05,) * 20, sleep=lambda _: anyio.sleep(0.01))
    job = make_job()
    await journal.create_job(job)
    seen: list[tuple[float, str, int | None]] = []
    journal.bus.listen(lambda e: seen.append((e.ts, e.kind, e.rank)))
    holder = locked(db.path)  # the stored event's commit waits for the lock: the live ones come meanwhile

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(journal.event, job, "rank.joined", rank=0))
            await anyio.lowlevel.checkpoint()
            for i in range(5):
                await journal.event(job, "rank.progress", rank=i, persist=False)
            assert seen == []  # held behind the stored event that is stamped before them
            holder.rollback()  # now the stored event's retry commits it, and all six are published
            holder.close()
    assert [kind for _, kind, _ in seen] == ["rank.joined"] + ["rank.progress"] * 5
    assert [ts for ts, _, _ in seen] == sorted(ts for ts, _, _ in seen)
    cancelled = anyio.CancelScope()

    async def stored_then_cancelled() -> None:
        with cancelled:
            await journal.event(job, "rank.left", rank=1)

    holder = locked(db.path)
    async with anyio.create_task_group() as tg:  # a write cancelled on the way holds back nothing
        tg.start_soon(stored_then_cancelled)
        await anyio.lowlevel.checkpoint()
        cancelled.cancel()
    holder.rollback()
    holder.close()
    await journal.event(job, "rank.progress", rank=9, persist=False)
    assert seen[-1][1:] == ("rank.progress", 9)
