"""Retention: ended jobs older than the retention period are pruned by one task that sleeps until the
oldest ended job expires, or until told that something changed (a job ended, a reload); it never polls.

The expiry times live in the database (an index on finished_at), not in memory: a long history costs
no memory here.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
import structlog

from ..store.errors import StorageError
from ..store.journal import Journal

log = structlog.get_logger("ddpd")

RETRY = 60.0  # seconds before a prune that could not write is tried again
BATCH = 200  # jobs pruned per look


class Retention:
    def __init__(self, journal: Journal, retention: float, clock: Callable[[], float]) -> None:
        self.journal = journal
        self.retention = retention  # seconds; 0: keep forever
        self.clock = clock  # wall-clock time, as jobs' finished_at
        self._wake = anyio.Event()

    def wake(self) -> None:
        """Look again: a job ended (the first to expire, when none was), or the retention changed."""
        self._wake.set()

    def reconfigure(self, retention: float) -> None:
        """A reloaded retention (seconds; 0: keep forever): looked at again at once."""
        self.retention = retention
        self.wake()

    async def next_expiry(self) -> float | None:
        if self.retention <= 0:
            return None
        oldest = await self.journal.oldest_ended()
        return None if oldest is None else oldest + self.retention

    async def run(self, prune: Callable[[str], Awaitable[None]]) -> None:
        """Prune each expired job (by id); a prune that fails (StorageError) is tried again later."""
        while True:
            self._wake = anyio.Event()
            delay = float("inf")
            try:
                at = await self.next_expiry()
                now = self.clock()
                if at is not None and at <= now:
                    for job_id in await self.journal.ended_before(now - self.retention, BATCH):
                        await prune(job_id)
                    continue
                if at is not None:
                    delay = at - now
            except StorageError as exc:
                log.error("job.prune_failed", error=exc.message)
                delay = RETRY
            except Exception as exc:  # a read that failed (locked, disk gone): look again later
                log.error("job.prune_failed", error=repr(exc))
                delay = RETRY
            with anyio.move_on_after(delay):
                await self._wake.wait()
