"""Retention: when each ended job expires, and the task that prunes it then (it sleeps until the next
expiry or until told of a sooner one; it never polls)."""

from __future__ import annotations

import heapq
import math
from collections.abc import Awaitable, Callable, Iterable

import anyio
import structlog

from . import lifecycle
from .errors import StorageError
from .records import Job

log = structlog.get_logger("ddpd")

RETRY = 60.0  # seconds before a prune that could not write is tried again


class Retention:
    def __init__(self, retention: float, clock: Callable[[], float]) -> None:
        self.retention = retention
        self.clock = clock  # wall-clock time, as jobs' finished_at
        self._heap: list[tuple[float, str]] = []  # (prune time, job id)
        self._wake = anyio.Event()

    def add(self, job: Job) -> None:
        """An ended job (just ended, or found at recovery) takes its place in the heap."""
        at = lifecycle.expires_at(job.state, job.finished_at, self.retention)
        if at is None:
            return
        if not self._heap or at < self._heap[0][0]:
            self._wake.set()  # sooner than the task sleeps for
        heapq.heappush(self._heap, (at, job.id))

    def reset(self, retention: float, jobs: Iterable[Job]) -> None:
        """A new retention period (reload): every ended job's expiry again."""
        self.retention = retention
        self._heap = []
        for job in jobs:
            self.add(job)
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    async def run(self, lookup: Callable[[str], Job | None], prune: Callable[[Job], Awaitable[None]]) -> None:
        """Prune each job when it expires; a prune that fails (StorageError) is tried again later."""
        while True:
            self._wake = anyio.Event()
            now = self.clock()
            while self._heap and self._heap[0][0] <= now:
                _, job_id = heapq.heappop(self._heap)
                job = lookup(job_id)
                if job is None or lifecycle.expires_at(job.state, job.finished_at, self.retention) is None:
                    continue  # removed already, or retention turned off
                try:
                    await prune(job)
                except StorageError as exc:
                    log.error("job.prune_failed", job_id=job.id, error=exc.message)
                    heapq.heappush(self._heap, (now + RETRY, job.id))
                    break
            delay = self._heap[0][0] - self.clock() if self._heap else math.inf
            with anyio.move_on_after(max(delay, 0.0)):
                await self._wake.wait()
