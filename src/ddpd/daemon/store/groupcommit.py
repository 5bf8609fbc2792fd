"""Group commit: the journal's writes, several per SQLite transaction, never raised for storage failures.

The writes queued while a transaction is being committed go together into the next one (each caller
still returns only once its own write is on disk), so a burst of rank events costs a few fsyncs, not
one each. A write that fails (database locked past its busy timeout, disk full, read-only) is retried
with a bounded backoff (a batch that fails is tried write by write), then logged as
`journal.write_failed`, published on the bus and dropped (None), so the in-memory state stays
authoritative and the daemon keeps supervising. An exception that is not a storage failure (a bug in
the write) is raised to its own caller.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import structlog

from ...protocol.control import EventView
from .bus import EventBus
from .state import StateDB

log = structlog.get_logger("ddpd")

WRITE_RETRIES = (0.1, 0.5, 1.0)  # pauses between tries of a failed write (each try waits the busy timeout)
DEGRADED_FOR = 30.0  # seconds after a write was given up during which writes are tried once only


class GroupCommit:
    """Runs writes in shared transactions; counts the batches committed and the writes given up."""

    def __init__(self, db: StateDB, bus: EventBus, *, retries: Sequence[float] = WRITE_RETRIES,
                 sleep: Callable[[float], Awaitable[None]] = anyio.sleep) -> None:
        self.db = db
        self.bus = bus
        self._retries = tuple(retries)
        self._sleep = sleep
        self.failed_writes = 0
        self.batches = 0  # transactions committed
        self._degraded_until = 0.0  # monotonic: storage failed lately, do not stall supervision on retries
        self._queue: list[_Op] = []  # writes waiting for the next transaction
        self._flushing = False  # a writer is committing batches (the others wait for `_flushed`)
        self._flushed = anyio.Event()

    async def write(self, what: str, fn: Callable[[sqlite3.Connection], Any], job_id: str | None = None) -> Any:
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
