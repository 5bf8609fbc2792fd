"""Retention: ended jobs older than the retention period are pruned, and each user's history is kept
within its bounds, by one task that sleeps until the oldest ended job expires, or until told that
something changed (a job ended, a reload); it never polls.

The expiry times live in the database (an index on finished_at), not in memory: a long history costs
no memory here.

Per-user bounds (`max_history_per_user` ended jobs, `max_history_bytes_per_user` bytes of the
database): when a user's job ends, that user is looked at, and its oldest ended jobs are retired
until its history is within both (`past_bounds`). Only that user's jobs, never another's; never its
newest ended job (the one a `wait` just returned), nor a job an unended job waits for (`--after`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence, Set

import anyio
import structlog

from ..store.errors import StorageError
from ..store.journal import Journal
from .live import LiveConfig

log = structlog.get_logger("ddpd")

RETRY = 60.0  # seconds before a prune that could not write is tried again
BATCH = 200  # jobs pruned per look


def past_bounds(held: Sequence[tuple[str, int]], max_jobs: int, max_bytes: int, protected: Set[str]) -> list[str]:
    """Of one user's ended jobs, (id, stored bytes) oldest first, those to retire, oldest first: the
    oldest until at most `max_jobs` are left holding at most `max_bytes` (0: that bound is off),
    skipping `protected` ones (they still count) and never the newest."""
    count, total = len(held), sum(size for _, size in held)
    out: list[str] = []
    for job_id, size in held[:-1]:
        if not (max_jobs and count > max_jobs) and not (max_bytes and total > max_bytes):
            break
        if job_id in protected:
            continue
        out.append(job_id)
        count, total = count - 1, total - size
    return out


def beyond_bounds(count: int, size: int, max_jobs: int, max_bytes: int) -> bool:
    """Whether a user's history (`count` ended jobs, `size` bytes) is past one of its bounds (0: off)."""
    return bool((max_jobs and count > max_jobs) or (max_bytes and size > max_bytes))


class Retention:
    def __init__(self, journal: Journal, live: LiveConfig, clock: Callable[[], float]) -> None:
        self.journal = journal
        self.live = live  # the daemon's current config (its `retention`: read at each look)
        self.clock = clock  # wall-clock time, as jobs' finished_at
        self._wake = anyio.Event()
        self._users: set[int] = set()  # users whose history may be past its bounds

    def wake(self) -> None:
        """Look again: a job ended (the first to expire, when none was), or the retention changed."""
        self._wake.set()

    def ended(self, uid: int) -> None:
        """A job of `uid` ended: its history is looked at against the bounds, and expiry again."""
        self._users.add(uid)
        self.wake()

    @property
    def retention(self) -> float:
        """Seconds an ended job is kept (0: forever), as the current config says."""
        return self.live.current.retention

    async def next_expiry(self) -> float | None:
        if self.retention <= 0:
            return None
        oldest = await self.journal.oldest_ended()
        return None if oldest is None else oldest + self.retention

    async def run(self, prune: Callable[[str], Awaitable[None]], retire: Callable[[int], Awaitable[object]]) -> None:
        """Retire what is past each user's bounds (`retire(uid)`), then prune each expired job (by id); a
        prune that fails (StorageError) is tried again later."""
        while True:
            self._wake = anyio.Event()
            delay = float("inf")
            users, self._users = self._users, set()
            try:
                for uid in sorted(users):
                    await retire(uid)
                    users.discard(uid)
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
            self._users |= users  # those not looked at yet: at the next look
            with anyio.move_on_after(delay):
                await self._wake.wait()
