"""The keeper of an attempt's rank logs: each stream is looked at when it grew, never on a clock of its own.

One `LogKeeper` per attempt holds one inotify instance (`inotify`) with a watch on each stream (the
daemon's own fd of it). Its task (`run`) sleeps until a watched file is written to, then waits for
the next tick (`logindex.TICK` after its last look, so a stamp is still within a tick) and looks at
the ranks whose logs changed, all in one call off the loop (on the job-file limiter, shielded and
bounded by ROTATE_TIMEOUT): an index entry for what grew, a rotation for a log past its limit
(`logindex.tick`). A rank is also looked at once at the first tick after its watches were added
(what it wrote before they were there). A rank that writes nothing costs nothing after that,
however many there are.

Where no watch can be had (inotify missing, or the user's instance or watch limit reached) the
streams are polled instead, every tick, all of the attempt's in one call; an overflowed event
queue makes the next look cover every rank. Once a rank has exited (also when cancelled: the
attempt ends as soon as its ranks have), `keep_logs` has one last look at its logs, so that its
last lines are stamped and its logs are within their limit once the job has ended.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Protocol

import anyio
import anyio.to_thread
import structlog

from ..contain import files
from ..store.eventbudget import EventBudget
from ..store.journal import Journal
from ..store.records import Job, Rank
from . import logrotate
from .inotify import Inotify
from .logindex import TICK, LiveStream, RankLogs
from .logrotate import ROTATE_TIMEOUT

log = structlog.get_logger("ddpd")

Done = list[tuple[LiveStream, logrotate.Rotated | OSError]]


class KeptRank(Protocol):
    """What `keep_logs` reads of a live rank (the attempt's `RankHandle`)."""

    @property
    def rank(self) -> Rank: ...

    @property
    def logs(self) -> RankLogs | None: ...

    @property
    def exited(self) -> anyio.Event: ...


@dataclass(eq=False)
class Watched:
    """One rank's logs under the keeper: its watches (none: polled) and whether it grew unseen."""

    rank: int
    logs: RankLogs
    max_bytes: int
    wds: list[int] = field(default_factory=list)
    polled: bool = False


class LogKeeper:
    """An attempt's rank logs, looked at when written to (inotify), or polled where that is not to be had."""

    def __init__(self, journal: Journal, job: Job, attempt: int) -> None:
        self.journal, self.job, self.attempt = journal, job, attempt
        self._by_wd: dict[int, Watched] = {}
        self._polled: set[Watched] = set()
        self._fresh: set[Watched] = set()  # added since the last look: what they wrote before is looked at
        self._all: set[Watched] = set()
        self._lock = anyio.Lock()  # one look at a time: a rank's last look waits for the tick's
        self._waiting: anyio.CancelScope | None = None
        self._last = -math.inf
        self.looks = 0  # looks done (a tick's or a rank's last one), counted once each is over
        self.ranks_looked = 0  # ranks looked at in them: what idle ranks must not grow
        self._budgets: dict[int, EventBudget] = {}  # persisted rotation events per rank (store.eventbudget)
        try:
            self._inotify: Inotify | None = Inotify()
        except OSError as exc:
            log.warning("rank.log_watch_unavailable", job_id=job.id, attempt=attempt, error=str(exc))
            self._inotify = None

    def add(self, rank: int, logs: RankLogs, max_bytes: int) -> Watched:
        """Watch a rank's streams (blocking for microseconds: an inotify_add_watch per stream)."""
        w = Watched(rank=rank, logs=logs, max_bytes=max_bytes)
        try:
            if self._inotify is None:
                raise OSError("no inotify")
            for stream in logs.streams:
                wd = self._inotify.watch(stream.fd)
                w.wds.append(wd)
                self._by_wd[wd] = w
        except OSError as exc:
            if self._inotify is not None:
                log.warning("rank.log_watch_unavailable", job_id=self.job.id, attempt=self.attempt, rank=rank,
                            error=str(exc))
            w.polled = True
            self._polled.add(w)
        self._all.add(w)
        self._fresh.add(w)  # a rank may have written before its watch was there: one look at the next tick
        if self._waiting is not None:
            self._waiting.cancel()
        return w

    async def run(self) -> None:
        """Look at what grew, at most once a tick, until cancelled."""
        while True:
            await self._wait_for_growth()
            await anyio.sleep(max(0.0, self._last + TICK - time.monotonic()))
            due = self._due()
            if due:
                async with self._lock:
                    await self._look(due)

    async def _wait_for_growth(self) -> None:
        if self._fresh:
            return
        with anyio.CancelScope() as self._waiting:
            if self._inotify is None:
                await anyio.sleep(TICK)
            elif self._polled:
                with anyio.move_on_after(TICK):
                    await anyio.wait_readable(self._inotify.fd)
            else:
                await anyio.wait_readable(self._inotify.fd)
        self._waiting = None

    def _due(self) -> list[Watched]:
        """The ranks to look at now: those whose logs were written to, and the polled ones."""
        due = self._polled | self._fresh
        self._fresh = set()
        if self._inotify is not None:
            fired, overflow = self._inotify.read()
            if overflow:
                return list(self._all)
            due.update(self._by_wd[wd] for wd in fired if wd in self._by_wd)
        return list(due)

    async def final(self, w: Watched) -> None:
        """The rank has exited: no more watching; one last look, shielded and bounded."""
        self._all.discard(w)
        self._polled.discard(w)
        self._fresh.discard(w)
        for wd in w.wds:
            self._by_wd.pop(wd, None)
            if self._inotify is not None:
                try:
                    self._inotify.unwatch(wd)
                except OSError:
                    pass
        with anyio.CancelScope(shield=True):
            async with self._lock:
                await self._look([w])

    def close(self) -> None:
        """The attempt is over (every rank's last look is done): the inotify instance goes."""
        if self._inotify is not None:
            self._inotify.close()

    async def _look(self, due: list[Watched]) -> None:
        """One look at the ranks' logs, in one thread call; shielded (a rotation under way is never
        abandoned by a cancel, nor left untold) and bounded (a hung filesystem is: their fds are then
        left to the thread to close)."""
        self._last = time.monotonic()
        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(ROTATE_TIMEOUT) as waited:
                done = await anyio.to_thread.run_sync(_tick_each, due, time.time(), limiter=files._limit(),
                                                      abandon_on_cancel=True)
            if waited.cancelled_caught:
                for w in due:
                    log.warning("rank.log_check_stuck", job_id=self.job.id, attempt=self.attempt, rank=w.rank,
                                seconds=ROTATE_TIMEOUT)
                    w.logs.close()
                return
            self.looks += 1
            self.ranks_looked += len(due)
            for w, results in done:
                await self._tell(w.rank, results)

    async def _tell(self, rank: int, results: Done) -> None:
        for stream, result in results:
            name = "stderr" if stream.log.endswith(".err") else "stdout"
            if isinstance(result, OSError):
                log.warning("rank.log_rotation_failed", job_id=self.job.id, attempt=self.attempt, rank=rank,
                            stream=name, error=str(result))
            else:  # a rank writing without end rotates at every look: kept within its budget, then live only
                budget = self._budgets.setdefault(rank, EventBudget())
                await self.journal.event(self.job, "rank.log_rotated", rank=rank, stream=name, kept=result.kept,
                                         dropped=result.dropped, persist=budget.admit(time.monotonic()))


def _tick_each(due: list[Watched], now: float) -> list[tuple[Watched, Done]]:
    """`RankLogs.tick_all` on each rank (blocking): what rotated or failed, by rank."""
    out: list[tuple[Watched, Done]] = []
    for w in due:
        done = w.logs.tick_all(now, w.max_bytes)
        if done:
            out.append((w, done))
    return out


async def keep_logs(h: KeptRank, keeper: LogKeeper, max_bytes: int) -> None:
    """Keep the rank's logs under `keeper` until it has exited, then look at them a last time."""
    if h.logs is None:
        return
    w = keeper.add(h.rank.rank, h.logs, max_bytes)
    try:
        await h.exited.wait()
    finally:
        await keeper.final(w)
