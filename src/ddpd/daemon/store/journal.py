"""The journal: the one owner of the state database's queries, and the event stream.

Every state change is one SQLite write, one event for followers and one structured log line. Writes are
group-committed: the writes queued while a transaction is being committed go together into the next one
(each caller still returns only once its own write is on disk), so a burst of rank events costs a few
fsyncs, not one each. Writes made while jobs are supervised never raise: a write that fails (database
locked past its busy timeout, disk full, read-only) is retried with a bounded backoff (a batch that fails
is tried write by write), then logged as `journal.write_failed` and dropped, so the in-memory state stays
authoritative and the daemon keeps supervising. Only `create_job` (a new submission) and `delete_job`
raise `StorageError`: a job is saved before it is published, and a failed save leaves no trace.

Events reach followers in the order of their stamps: an event is stamped when it is made, and one made
while an earlier one is still being committed (a live progress event, never stored, say) is held until
the earlier one is published, then published right after it (`bus.Outbox`); no caller waits for that.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import msgspec
import structlog

from ...protocol import JobSpec, JobState, RankState, check_job_transition, check_rank_transition
from ...protocol.control import EventView, RootCause
from ...protocol.limits import clip_text
from ...protocol.nodes import NodeView
from .bus import EventBus, Outbox
from .errors import StorageError
from .records import Job, Rank
from .state import STORED_BYTES, StateDB

__all__ = ["EventBus", "Journal", "StorageError"]

log = structlog.get_logger("ddpd")

WRITE_RETRIES = (0.1, 0.5, 1.0)  # pauses between tries of a failed write (each try waits the busy timeout)
DEGRADED_FOR = 30.0  # seconds after a write was given up during which writes are tried once only
LOG_TRACEBACK_CHARS = 4000
_FINAL = "(" + ", ".join(f"'{s.value}'" for s in JobState if s.final) + ")"  # SQL: the final states
_WARN_EVENTS = frozenset({"rank.heartbeat_missed", "job.teardown", "rank.failed", "job.leftover_killed",
                          "rank.unkillable", "rank.protocol_error", "gpu.xid", "gpu.ecc_error", "gpu.nvml_failing",
                          "gpu.quarantined", "job.gpu_idle", "job.notify_failed", "rank.lost",
                          "rank.replace_failed"})


class Journal:
    """The one place job and rank state changes are recorded, and the only code that speaks SQL."""

    def __init__(self, db: StateDB, bus: EventBus, *, retries: Sequence[float] = WRITE_RETRIES,
                 sleep: Callable[[float], Awaitable[None]] = anyio.sleep) -> None:
        self.db = db
        self.bus = bus
        self._retries = tuple(retries)
        self._sleep = sleep
        self.failed_writes = 0
        self.batches = 0  # transactions committed by the group commit
        self._outbox = Outbox(bus)
        self._degraded_until = 0.0  # monotonic: storage failed lately, do not stall supervision on retries
        self._queue: list[_Op] = []  # writes waiting for the next transaction
        self._flushing = False  # a writer is committing batches (the others wait for `_flushed`)
        self._flushed = anyio.Event()

    # -- writes that never raise -------------------------------------------------------------------

    async def _write(self, what: str, fn: Callable[[sqlite3.Connection], Any], job_id: str | None = None) -> Any:
        """Run a write (group commit: with whatever others were queued meanwhile, in one transaction)
        and return its result; a write that cannot be done is logged and dropped (None), never raised."""
        op = _Op(what, fn, job_id)
        self._queue.append(op)
        while not op.done:
            if self._flushing:
                await self._flushed.wait()
            else:
                await self._flush(op)
        if op.error is not None:  # not a storage failure: a bug in the write, raised to its own caller
            raise op.error
        return op.result

    async def _flush(self, mine: _Op) -> None:
        """Commit the queued writes, batch after batch, until `mine` is done; then the next waiting
        writer commits what is queued since (no writer is kept committing the others' writes). A
        batch taken by a writer that is cancelled meanwhile goes back to the head of the queue."""
        self._flushing = True
        batch: list[_Op] = []
        try:
            while self._queue and not mine.done:
                batch, self._queue = self._queue, []
                await self._commit(batch)
                self.batches += 1
        finally:
            self._queue[:0] = [op for op in batch if not op.done]
            self._flushing = False
            flushed, self._flushed = self._flushed, anyio.Event()
            flushed.set()

    async def _commit(self, batch: list[_Op]) -> None:
        """One transaction for the batch; if it fails, each write on its own (one bad write, or a locked
        database, then costs only itself its retries)."""
        if len(batch) > 1 and time.monotonic() >= self._degraded_until:
            try:
                results = await self.db.run(lambda c: _in_transaction(c, [op.fn for op in batch]))
            except Exception:  # each write is then tried on its own, and fails on its own
                pass
            else:
                for op, result in zip(batch, results, strict=True):
                    op.result, op.done = result, True
                return
        for op in batch:
            try:
                op.result = await self._write_one(op)
            except Exception as exc:
                op.error = exc
            op.done = True

    async def _write_one(self, op: _Op) -> Any:
        """Run one write; retry a failure with a bounded backoff, then log it and go on (None).

        Once a write was given up, the next ones for DEGRADED_FOR seconds are tried once only, so a
        long outage costs each write one busy timeout, not the whole backoff.
        """
        what, job_id = op.what, op.job_id
        retries = () if time.monotonic() < self._degraded_until else self._retries
        for pause in (*retries, None):
            try:
                result = (await self.db.run(lambda c: _in_transaction(c, [op.fn])))[0]
                self._degraded_until = 0.0
                return result
            except sqlite3.Error as exc:
                if pause is None:
                    self.failed_writes += 1
                    self._degraded_until = time.monotonic() + DEGRADED_FOR
                    log.error("journal.write_failed", what=what, job_id=job_id, error=str(exc))
                    self.bus.publish(EventView(seq=0, ts=time.time(), kind="journal.write_failed", job_id=job_id,
                                               attempt=None, rank=None, data={"what": what, "error": str(exc)}))
                    return None
                log.warning("journal.write_retry", what=what, job_id=job_id, error=str(exc), pause=pause)
                await self._sleep(pause)
        return None  # pragma: no cover (the loop returns)

    async def event(
        self, job: Job | None, kind: str, *, rank: int | None = None, persist: bool = True, **data: Any
    ) -> None:
        ts, place = time.time(), self._outbox.take()
        job_id = job.id if job else None
        attempt = job.attempt if job else None
        seq = 0
        view: EventView | None = None
        try:
            if persist:
                text = json.dumps(data, default=str)
                seq = await self._write(kind, lambda c: c.execute(
                    "INSERT INTO events (ts, job_id, attempt, rank, kind, data) VALUES (?, ?, ?, ?, ?, ?)",
                    (ts, job_id, attempt, rank, kind, text)).lastrowid, job_id) or 0
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
        await self._write("job", lambda c: _upsert(c, "jobs", ("id",), row), job.id)

    async def save_attempt(self, job: Job, attempt: int, *, pgid: int | None, store_port: int | None,
                           token: str, cgroup: str | None = None) -> None:
        """The attempt's row: its group, store port, marker token and cgroup (what recovery kills)."""
        row = {"job_id": job.id, "attempt": attempt, "pgid": pgid, "store_port": store_port, "token": token,
               "started_at": time.time(), "cgroup": cgroup}
        await self._write("attempt", lambda c: _upsert(c, "attempts", ("job_id", "attempt"), row), job.id)

    async def save_rank(self, job: Job, rank: Rank) -> None:
        row = rank_row(job.id, rank)
        await self._write("rank", lambda c: _upsert(c, "ranks", ("job_id", "attempt", "rank"), row), job.id)

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
            await self.save_job(job)
            data.update({"from": old.value, "to": new.value, "reason": reason})
            await self.event(job, "job.state_changed", **data)
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

    # -- reads ---------------------------------------------------------------------------------

    async def load_curve(self, job_id: str) -> str | None:
        """A job's stored curve (JSON), None when it has none."""
        rows = await self.db.run(lambda c: c.execute("SELECT data FROM curves WHERE job_id = ?", (job_id,)).fetchall())
        return str(rows[0]["data"]) if rows else None

    async def load_jobs(self, recent_ended: int | None = None) -> list[Job]:
        """Jobs by seq, with their latest attempt's ranks: every job, or the unended ones and the most
        recent `recent_ended` ended ones (the rest stays on disk: `load_job`, `list_jobs_page`)."""
        sql = "SELECT * FROM jobs ORDER BY seq"
        if recent_ended is not None:
            sql = (f"SELECT * FROM jobs WHERE state NOT IN {_FINAL} UNION ALL "
                   f"SELECT * FROM (SELECT * FROM jobs WHERE state IN {_FINAL} ORDER BY seq DESC LIMIT ?) "
                   "ORDER BY seq")
        rows = await self.db.run(lambda c: c.execute(sql, () if recent_ended is None else (recent_ended,)).fetchall())
        return await self._with_ranks([job_from_row(r) for r in rows])

    async def load_job(self, job_id: str) -> Job | None:
        rows = await self.db.run(lambda c: c.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchall())
        return (await self._with_ranks([job_from_row(rows[0])]))[0] if rows else None

    async def list_jobs_page(self, limit: int, before: int | None = None, *, owner_uid: int | None = None,
                             active: bool = False) -> list[Job]:
        """Up to `limit` jobs with seq below `before`, newest first; one owner's, or only unended ones."""
        sql, params = "SELECT * FROM jobs WHERE seq < ?", [before if before is not None else 2**63 - 1]
        if owner_uid is not None:
            sql += " AND owner_uid = ?"
            params.append(owner_uid)
        if active:
            sql += f" AND state NOT IN {_FINAL}"
        rows = await self.db.run(lambda c: c.execute(sql + " ORDER BY seq DESC LIMIT ?", (*params, limit)).fetchall())
        return await self._with_ranks([job_from_row(r) for r in rows])

    async def ids_with_prefix(self, prefix: str, limit: int) -> list[str]:
        """Up to `limit` job ids that start with `prefix` (a range on the primary key), oldest first."""
        if not prefix:
            return []
        upper = prefix[:-1] + chr(min(ord(prefix[-1]) + 1, 0x10FFFF))
        rows = await self.db.run(lambda c: c.execute(
            "SELECT id FROM jobs WHERE id >= ? AND id < ? ORDER BY seq LIMIT ?", (prefix, upper, limit)).fetchall())
        return [str(r["id"]) for r in rows]

    async def job_by_key(self, owner_uid: int, key: str) -> str | None:
        rows = await self.db.run(lambda c: c.execute(
            "SELECT id FROM jobs WHERE owner_uid = ? AND idempotency_key = ?", (owner_uid, key)).fetchall())
        return str(rows[0]["id"]) if rows else None

    async def ended_counts(self) -> dict[JobState, int]:
        rows = await self.db.run(lambda c: c.execute(
            f"SELECT state, count(*) AS n FROM jobs WHERE state IN {_FINAL} GROUP BY state").fetchall())
        return {JobState(r["state"]): int(r["n"]) for r in rows}

    async def load_usage(self) -> dict[int, tuple[float, float, float]]:
        """Every user's saved fair-share usage: uid -> (GPU-seconds, CPU-slot-seconds, as of)."""
        rows = await self.db.run(lambda c: c.execute("SELECT uid, gpu_seconds, cpu_seconds, at FROM usage").fetchall())
        return {int(r["uid"]): (float(r["gpu_seconds"]), float(r["cpu_seconds"]), float(r["at"])) for r in rows}

    async def oldest_ended(self) -> float | None:
        rows = await self.db.run(lambda c: c.execute(
            f"SELECT min(finished_at) AS t FROM jobs WHERE state IN {_FINAL}").fetchall())
        return None if rows[0]["t"] is None else float(rows[0]["t"])

    async def ended_before(self, cutoff: float, limit: int) -> list[str]:
        """Ids of ended jobs that finished before `cutoff`, oldest first."""
        rows = await self.db.run(lambda c: c.execute(
            f"SELECT id FROM jobs WHERE state IN {_FINAL} AND finished_at < ? ORDER BY finished_at LIMIT ?",
            (cutoff, limit)).fetchall())
        return [str(r["id"]) for r in rows]

    async def history_totals(self, owner_uid: int) -> tuple[int, int]:
        """One user's ended jobs on record: how many, and the bytes their records take."""
        rows = await self.db.run(lambda c: c.execute(
            f"SELECT count(*) AS n, total(coalesce(stored_bytes, length(CAST(spec AS BLOB)))) AS b FROM jobs "
            f"WHERE owner_uid = ? AND finished_at IS NOT NULL AND state IN {_FINAL}", (owner_uid,)).fetchall())
        return int(rows[0]["n"]), int(rows[0]["b"])

    async def history_of(self, owner_uid: int) -> list[tuple[str, int]]:
        """One user's ended jobs, oldest first: (id, the bytes its record takes)."""
        rows = await self.db.run(lambda c: c.execute(
            "SELECT id, coalesce(stored_bytes, length(CAST(spec AS BLOB))) AS b FROM jobs "
            f"WHERE owner_uid = ? AND finished_at IS NOT NULL AND state IN {_FINAL} ORDER BY finished_at, seq",
            (owner_uid,)).fetchall())
        return [(str(r["id"]), int(r["b"])) for r in rows]

    async def _with_ranks(self, jobs: list[Job]) -> list[Job]:
        """Fill each job's ranks of its latest attempt, in one query."""
        if not jobs:
            return jobs
        ids = json.dumps([j.id for j in jobs])
        rows = await self.db.run(lambda c: c.execute(
            "SELECT r.* FROM ranks r JOIN jobs j ON r.job_id = j.id AND r.attempt = j.attempt "
            "WHERE r.job_id IN (SELECT value FROM json_each(?)) ORDER BY r.job_id, r.rank", (ids,)).fetchall())
        by_job: dict[str, list[Rank]] = {}
        for r in rows:
            by_job.setdefault(r["job_id"], []).append(rank_from_row(r))
        for job in jobs:
            job.ranks = by_job.get(job.id, [])
        return jobs

    async def attempt_ranks(self, job_id: str, attempt: int) -> list[int]:
        """The global ranks an attempt started on this daemon, in order."""
        rows = await self.db.run(lambda c: c.execute(
            "SELECT rank FROM ranks WHERE job_id = ? AND attempt = ? ORDER BY rank", (job_id, attempt)).fetchall())
        return [int(r["rank"]) for r in rows]

    async def attempt_tokens(self, job_id: str, attempt: int) -> list[str]:
        """The marker tokens recorded for an attempt (its processes carry DDPD_ATTEMPT=job:attempt:token)."""
        rows = await self.db.run(lambda c: c.execute(
            "SELECT token FROM attempts WHERE job_id = ? AND attempt = ?", (job_id, attempt)).fetchall())
        return [str(r["token"]) for r in rows]

    async def attempt_cgroups(self, job_id: str, attempt: int) -> list[str]:
        """The cgroups recorded for an attempt (killed whole at recovery, before the marker sweep)."""
        rows = await self.db.run(lambda c: c.execute(
            "SELECT cgroup FROM attempts WHERE job_id = ? AND attempt = ? AND cgroup IS NOT NULL",
            (job_id, attempt)).fetchall())
        return [str(r["cgroup"]) for r in rows]

    async def list_events(self, job_id: str | None, since: int, limit: int) -> list[EventView]:
        """Up to `limit` recorded events after `since` (seq), oldest first; one job's or all."""
        sql = "SELECT * FROM events WHERE seq > ?"
        params: tuple[Any, ...] = (since,)
        if job_id is not None:
            sql += " AND job_id = ?"
            params += (job_id,)
        rows = await self.db.run(lambda c: c.execute(sql + " ORDER BY seq LIMIT ?", (*params, limit)).fetchall())
        return [EventView(seq=r["seq"], ts=r["ts"], kind=r["kind"], job_id=r["job_id"], attempt=r["attempt"],
                          rank=r["rank"], data=msgspec.json.decode(r["data"])) for r in rows]


@dataclass(eq=False)
class _Op:
    """A write waiting for its transaction, then its result."""

    what: str
    fn: Callable[[sqlite3.Connection], Any]
    job_id: str | None
    result: Any = None
    error: Exception | None = None
    done: bool = False


def _in_transaction(conn: sqlite3.Connection, fns: list[Callable[[sqlite3.Connection], Any]]) -> list[Any]:
    """Run `fns` in one transaction (all or none); their results."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        results = [fn(conn) for fn in fns]
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
    return results


def _upsert(conn: sqlite3.Connection, table: str, key: tuple[str, ...], row: dict[str, Any]) -> None:
    cols = ", ".join(row)
    marks = ", ".join(f":{c}" for c in row)
    updates = ", ".join(f"{c}=excluded.{c}" for c in row if c not in key)
    conn.execute(f"INSERT INTO {table} ({cols}) VALUES ({marks}) ON CONFLICT({', '.join(key)}) DO UPDATE SET {updates}",
                 row)


def job_row(job: Job) -> dict[str, Any]:
    return {
        "id": job.id, "seq": job.seq, "name": job.name, "owner_uid": job.owner_uid,
        "spec": msgspec.json.encode(job.spec).decode(), "state": job.state.value, "attempt": job.attempt,
        "priority": job.spec.priority, "submitted_at": job.submitted_at, "started_at": job.started_at,
        "finished_at": job.finished_at, "reason": job.reason,
        "root_cause": None if job.root_cause is None else msgspec.json.encode(job.root_cause).decode(),
        "idempotency_key": job.idempotency_key,
        "nodes": msgspec.json.encode(job.nodes).decode() if job.nodes else None,
    }


def rank_row(job_id: str, rank: Rank) -> dict[str, Any]:
    return {
        "job_id": job_id, "attempt": rank.attempt, "rank": rank.rank, "state": rank.state.value, "pid": rank.pid,
        "pgid": rank.pgid, "step": rank.step, "loss": rank.loss, "exit_code": rank.exit_code,
        "signal": rank.signal, "checksum": rank.checksum, "log": rank.log, "stack_dump": int(rank.stack_dump),
        "replacements": rank.replacements,
    }


def _stored_spec(raw: str) -> tuple[JobSpec, str | None]:
    """The stored spec, or (an empty spec, why) when it no longer passes the spec's bounds (a row
    written before they existed): recovery must not stop on one old row."""
    try:
        return msgspec.json.decode(raw, type=JobSpec), None
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        return JobSpec(), f"the stored spec no longer passes the spec's bounds: {clip_text(str(exc), 1000)}"


def _stored_nodes(raw: str | None) -> list[NodeView]:
    """A multi-node job's node table as it was last saved (none: not a multi-node job, or unreadable)."""
    if raw is None:
        return []
    try:
        return msgspec.json.decode(raw, type=list[NodeView])
    except (msgspec.ValidationError, msgspec.DecodeError):
        return []


def job_from_row(row: Any) -> Job:
    spec, unreadable = _stored_spec(row["spec"])
    job = Job(
        id=row["id"], seq=row["seq"], name=row["name"], owner_uid=row["owner_uid"],
        spec=spec, state=JobState(row["state"]),
        submitted_at=row["submitted_at"], attempt=row["attempt"], started_at=row["started_at"],
        finished_at=row["finished_at"], reason=row["reason"],
        root_cause=None if row["root_cause"] is None else msgspec.json.decode(row["root_cause"], type=RootCause),
        idempotency_key=row["idempotency_key"], nodes=_stored_nodes(row["nodes"]),
    )
    if unreadable is not None and not job.state.final:  # never run a spec that is not the one submitted
        job.state, job.reason = JobState.FAILED, "spec_unreadable"
        job.root_cause = RootCause(reason="spec_unreadable", attempt=job.attempt, detail=unreadable)
    if job.state.final:
        job.finished.set()
    return job


def rank_from_row(row: Any) -> Rank:
    return Rank(
        rank=row["rank"], attempt=row["attempt"], state=RankState(row["state"]), pid=row["pid"], pgid=row["pgid"],
        step=row["step"], loss=row["loss"], exit_code=row["exit_code"], signal=row["signal"],
        checksum=row["checksum"], log=row["log"], stack_dump=bool(row["stack_dump"]),
        replacements=row["replacements"],
    )
