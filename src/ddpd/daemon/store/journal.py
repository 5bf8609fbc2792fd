"""The journal: the one owner of the state database's queries, and the event stream.

Every state change is one SQLite write, one event for followers and one structured log line. Writes are
group-committed (store.groupcommit: a burst of rank events costs a few fsyncs, not one each), and those
made while jobs are supervised never raise: a write that cannot be done is retried, then logged as
`journal.write_failed` and dropped, so the in-memory state stays authoritative and the daemon keeps
supervising. Only `create_job` (a new submission) and `delete_job` raise `StorageError`: a job is saved
before it is published, and a failed save leaves no trace. The reads are `StoredJobs`' (store.reads),
the rows' shapes store.rows'.

Events reach followers in the order of their stamps: an event is stamped when it is made, and one made
while an earlier one is still being committed (a live progress event, never stored, say) is held until
the earlier one is published, then published right after it (`bus.Outbox`); no caller waits for that.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
import structlog

from ...protocol import JobState, RankState, check_job_transition, check_rank_transition
from ...protocol.control import EventView
from .bus import EventBus, Outbox
from .errors import StorageError
from .groupcommit import WRITE_RETRIES, GroupCommit
from .reads import StoredJobs
from .records import Job, Rank
from .rows import job_row, rank_row, upsert
from .state import STORED_BYTES, StateDB

__all__ = ["EventBus", "Journal", "StorageError"]

log = structlog.get_logger("ddpd")

LOG_TRACEBACK_CHARS = 4000
_WARN_EVENTS = frozenset({"rank.heartbeat_missed", "job.teardown", "rank.failed", "job.leftover_killed",
                          "rank.unkillable", "rank.protocol_error", "gpu.xid", "gpu.ecc_error", "gpu.nvml_failing",
                          "gpu.quarantined", "job.gpu_idle", "job.notify_failed", "rank.lost",
                          "rank.replace_failed"})


class Journal(StoredJobs):
    """The one place job and rank state changes are recorded; with its reads (StoredJobs), the only code
    that speaks SQL."""

    def __init__(self, db: StateDB, bus: EventBus, *, retries: Sequence[float] = WRITE_RETRIES,
                 sleep: Callable[[float], Awaitable[None]] = anyio.sleep) -> None:
        super().__init__(db)
        self.bus = bus
        self._writes = GroupCommit(db, bus, retries=retries, sleep=sleep)
        self._outbox = Outbox(bus)

    # -- writes that never raise -------------------------------------------------------------------

    @property
    def failed_writes(self) -> int:
        """Writes given up (logged as journal.write_failed)."""
        return self._writes.failed_writes

    @property
    def batches(self) -> int:
        """Transactions committed by the group commit."""
        return self._writes.batches

    async def _write(self, what: str, fn: Callable[[sqlite3.Connection], Any], job_id: str | None = None) -> Any:
        """A write in the next group-committed transaction; its result, or None when it was given up."""
        return await self._writes.write(what, fn, job_id)

    async def event(
        self, job: Job | None, kind: str, *, rank: int | None = None, persist: bool = True,
        _with_row: Callable[[sqlite3.Connection], Any] | None = None, **data: Any
    ) -> None:
        """Record an event (`_with_row`: a row written in the same write, just before it)."""
        ts, place = time.time(), self._outbox.take()
        job_id = job.id if job else None
        attempt = job.attempt if job else None
        seq = 0
        view: EventView | None = None
        try:
            if persist:
                text = json.dumps(data, default=str)

                def insert(c: sqlite3.Connection) -> int:
                    if _with_row is not None:
                        _with_row(c)
                    return int(c.execute(
                        "INSERT INTO events (ts, job_id, attempt, rank, kind, data) VALUES (?, ?, ?, ?, ?, ?)",
                        (ts, job_id, attempt, rank, kind, text)).lastrowid or 0)

                seq = await self._write(kind, insert, job_id) or 0
            view = EventView(seq=seq, ts=ts, kind=kind, job_id=job_id, attempt=attempt, rank=rank, data=data)
        finally:
            self._outbox.put(place, view)  # published in stamp order (a cancelled write: nothing)
        if persist:
            level = "warning" if kind in _WARN_EVENTS else "info"
            fields = dict(data)
            if isinstance(fields.get("traceback"), str):  # its tail: where it failed, bounded for journald
                fields["traceback"] = fields["traceback"][-LOG_TRACEBACK_CHARS:]
            getattr(log, level)(kind, job_id=job_id, attempt=attempt, rank=rank, **fields)

    async def save_job(self, job: Job) -> None:
        row = job_row(job)
        await self._write("job", lambda c: upsert(c, "jobs", ("id",), row), job.id)

    async def save_attempt(self, job: Job, attempt: int, *, pgid: int | None, store_port: int | None,
                           token: str, cgroup: str | None = None) -> None:
        """The attempt's row: its group, store port, marker token and cgroup (what recovery kills)."""
        row = {"job_id": job.id, "attempt": attempt, "pgid": pgid, "store_port": store_port, "token": token,
               "started_at": time.time(), "cgroup": cgroup}
        await self._write("attempt", lambda c: upsert(c, "attempts", ("job_id", "attempt"), row), job.id)

    async def save_rank(self, job: Job, rank: Rank) -> None:
        row = rank_row(job.id, rank)
        await self._write("rank", lambda c: upsert(c, "ranks", ("job_id", "attempt", "rank"), row), job.id)

    async def job_state(self, job: Job, new: JobState, reason: str | None = None, *, finish: bool = True,
                        **data: Any) -> None:
        """Check and apply a transition in memory first, then record it; a final state sets job.finished
        (unless `finish` is False: the caller sets it once the job's last events are recorded, so that
        a `wait` returns after them)."""
        old = job.state
        check_job_transition(old, new)
        job.state = new
        now = time.time()
        if new is JobState.STARTING and job.started_at is None:
            job.started_at = now
        if reason is not None:
            job.reason = reason
        if new.final:
            job.finished_at = now
        try:
            # the row and its event in one write, queued now: the event takes its place in the journal
            # when the transition is decided, never after an event recorded while the row was written
            # (a rank.failed before "all ranks joined" that was decided before it)
            row = job_row(job)
            data.update({"from": old.value, "to": new.value, "reason": reason})
            await self.event(job, "job.state_changed", _with_row=lambda c: upsert(c, "jobs", ("id",), row), **data)
        finally:
            if new.final and finish:
                job.finished.set()

    async def rank_state(
        self, job: Job, rank: Rank, new: RankState, kind: str = "rank.state_changed", **data: Any
    ) -> None:
        old = rank.state
        check_rank_transition(old, new)
        rank.state = new
        await self.save_rank(job, rank)
        data.update({"from": old.value, "to": new.value})
        await self.event(job, kind, rank=rank.rank, **data)

    async def save_curves(self, curves: dict[str, str]) -> None:
        """Job curves (JSON by job id) in one transaction; a job no longer on record gets none."""
        def fn(c: sqlite3.Connection) -> None:
            c.executemany("INSERT INTO curves (job_id, data) SELECT ?, ? WHERE EXISTS "
                          "(SELECT 1 FROM jobs WHERE id = ?) ON CONFLICT(job_id) DO UPDATE SET data=excluded.data",
                          [(job_id, data, job_id) for job_id, data in curves.items()])

        await self._write("curves", fn)

    async def save_usage(self, rows: dict[int, tuple[float, float, float]]) -> None:
        """Users' fair-share usage: uid -> (GPU-seconds, CPU-slot-seconds, as of), in one write."""
        def fn(c: sqlite3.Connection) -> None:
            c.executemany("INSERT INTO usage (uid, gpu_seconds, cpu_seconds, at) VALUES (?, ?, ?, ?) "
                          "ON CONFLICT(uid) DO UPDATE SET gpu_seconds=excluded.gpu_seconds, "
                          "cpu_seconds=excluded.cpu_seconds, at=excluded.at",
                          [(uid, *row) for uid, row in rows.items()])

        await self._write("usage", fn)

    async def count_stored(self, job_id: str) -> None:
        """Record what an ended job's record takes in the database (`jobs.stored_bytes`: its history bound)."""
        await self._write("stored_bytes", lambda c: c.execute(
            f"UPDATE jobs SET stored_bytes = ({STORED_BYTES}) WHERE id = ?", (job_id,)), job_id)

    # -- writes a client waits on: they raise StorageError ---------------------------------------

    async def create_job(self, job: Job) -> None:
        """Insert a new job's row; StorageError if it cannot be written (the caller publishes nothing)."""
        row = job_row(job)
        cols = ", ".join(row)
        marks = ", ".join(f":{c}" for c in row)
        try:
            await self.db.run(lambda c: c.execute(f"INSERT INTO jobs ({cols}) VALUES ({marks})", row))
        except sqlite3.Error as exc:
            log.error("journal.submit_failed", job_id=job.id, error=str(exc))
            raise StorageError(f"the job could not be saved ({exc}); no job was created, retry later") from None

    async def delete_job(self, job_id: str) -> bool:
        """Remove a job's row, attempts, ranks and events in one transaction; whether it had a row (a
        job removed twice at once, by `rm` and by its retirement, is removed once)."""
        def fn(c: sqlite3.Connection) -> bool:
            c.execute("BEGIN IMMEDIATE")
            try:
                for table, col in (("events", "job_id"), ("ranks", "job_id"), ("attempts", "job_id"),
                                   ("curves", "job_id")):
                    c.execute(f"DELETE FROM {table} WHERE {col} = ?", (job_id,))
                had = c.execute("DELETE FROM jobs WHERE id = ?", (job_id,)).rowcount > 0
            except BaseException:
                c.execute("ROLLBACK")
                raise
            c.execute("COMMIT")
            return had

        try:
            return await self.db.run(fn)
        except sqlite3.Error as exc:
            raise StorageError(f"job {job_id} could not be removed ({exc}); retry later") from None
