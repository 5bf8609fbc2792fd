"""The warm pool's fork servers as ``ddpctl daemon`` and the web view show them (`PoolServers`):
each server's key (user, interpreter, a digest of the start-up environment), pid, state, memory,
forks served, spares and idle time. The key and the pid are detail: for the server's user, root and
the admin group, as a job's detail is (`visibility.detail_for`); anyone else sees the counts only.

Memory is Pss, read from ``/proc/PID/smaps_rollup`` of the server and of each of its ready spares.
That read walks the target's page tables under its mmap lock, so a process that holds the lock (a
page fault on a hung NFS mount, a huge munmap, a process stopped inside either) stalls the reader
for as long; these processes run the user's interpreter. So the read never runs on the event loop
(`PssCache`): one worker thread reads every pid of a round (`anyio.to_thread`, abandoned on
cancel), a request waits for its round at most READ_DEADLINE seconds, and a pid not read by then
shows as unknown (None), never an error and never a stall. Each value is kept CACHE_TTL seconds and
one round at most is in flight: a burst of requests (open web pages, a script) shares one read per
server, and a stuck read ties up one thread, never one per request (its pids stay unknown until it
ends). A pid that has gone (a spare taken and ended, a server that died) counts 0.
"""

from __future__ import annotations

import hashlib
import pwd
import threading
import time
from collections.abc import Collection, Mapping

import anyio
import anyio.to_thread
import structlog

from ...protocol.control import PoolServerView
from ..pool.members import ServerSnapshot
from ..pool.pool import WarmPool
from ..pool.poolkeys import PoolKey
from .replies import Detail

log = structlog.get_logger("ddpd")

READ_DEADLINE = 1.0  # seconds a request waits for a round of Pss reads (about 4 ms a process here)
CACHE_TTL = 2.0  # seconds a Pss value is shown before it is read again
FORGET_AFTER = 60.0  # seconds after which a pid's last value is dropped from the cache
ROLLUP_LIMIT = 16384  # bytes of smaps_rollup read (about 1 KiB in practice)


def pss_of(pid: int) -> int | None:
    """Blocking (the target's mmap lock): `pid`'s Pss in bytes; 0 where it has gone (or is a zombie,
    whose rollup is empty); None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            text = f.read(ROLLUP_LIMIT)
    except (FileNotFoundError, ProcessLookupError):
        return 0
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(b"Pss:"):
            fields = line.split()
            return int(fields[1]) * 1024 if len(fields) > 1 and fields[1].isdigit() else None
    return 0


class PssCache:
    """Pss per pid, read off the loop, one round at a time, each value kept `ttl` seconds."""

    def __init__(self, ttl: float = CACHE_TTL, deadline: float = READ_DEADLINE) -> None:
        self.ttl = ttl
        self.deadline = deadline
        self._lock = threading.Lock()  # `_values`, `_busy` and `_reading`: the reading thread writes them
        self._values: dict[int, tuple[int | None, float]] = {}  # pid: (Pss, when read, monotonic)
        self._busy: object | None = None  # the round in flight (its thread clears it when done)
        self._reading: object | None = None  # the round whose thread has started
        self._round: anyio.Event | None = None  # set when the round in flight has ended or timed out

    async def get(self, pids: Collection[int]) -> dict[int, int | None]:
        """Each pid's Pss, read within the last `ttl` seconds; None where no read finished in time."""
        stale = [p for p in pids if not self._fresh(p, time.monotonic())]
        if stale and self._busy is None:
            await self._read_round(stale)
        elif stale and self._round is not None:  # a round is in flight: share it (a stuck one: unknown)
            with anyio.move_on_after(self.deadline):
                await self._round.wait()
        now = time.monotonic()
        with self._lock:
            got = {p: self._values.get(p) for p in pids}
        return {p: g[0] if g is not None and now - g[1] <= self.ttl else None for p, g in got.items()}

    def _fresh(self, pid: int, now: float) -> bool:
        with self._lock:
            got = self._values.get(pid)
        return got is not None and now - got[1] <= self.ttl

    async def _read_round(self, pids: list[int]) -> None:
        token = object()
        with self._lock:
            self._busy = token
            self._values = {p: v for p, v in self._values.items() if time.monotonic() - v[1] < FORGET_AFTER}
        self._round = done = anyio.Event()
        try:
            with anyio.move_on_after(self.deadline) as scope:
                await anyio.to_thread.run_sync(self._read, pids, token, abandon_on_cancel=True)
            if scope.cancelled_caught:
                log.warning("pool.pss_slow", pids=pids, deadline=self.deadline)
        finally:
            done.set()
            with self._lock:  # Bug: cut short before its thread started (to_thread checkpoints first; the
                if self._reading is not token and self._busy is token:  # limiter's wait), the round
                    self._busy = None  # stayed in flight for good and every later Pss was unknown

    def _read(self, pids: list[int], token: object) -> None:
        """In the worker thread: read each pid of round `token`, storing each value as it comes (nothing
        where the round was given up before the thread started)."""
        with self._lock:
            if self._busy is not token:
                return
            self._reading = token
        try:
            for pid in pids:
                value = pss_of(pid)
                with self._lock:
                    self._values[pid] = (value, time.monotonic())
        finally:
            with self._lock:
                self._busy = None


def env_digest(key: PoolKey) -> str:
    """A short digest of the start-up environment the pool keys `key` by (12 hex digits)."""
    text = "\0".join(f"{name}={value}" for name, value in key.startup)
    return hashlib.sha256(text.encode(errors="surrogateescape")).hexdigest()[:12]


def server_view(s: ServerSnapshot, pss: Mapping[int, int | None], user: str | None, detail: bool,
                now: float) -> PoolServerView:
    """One server as shown to a viewer who may (`detail`) or may not see its key and pid."""
    parts = [pss.get(pid) for pid in (s.pid, *s.spares)]
    total = None if any(v is None for v in parts) else sum(v for v in parts if v is not None)
    return PoolServerView(uid=s.key.uid, state="ready" if s.ready else "starting", user=user,
                          pid=s.pid if detail else None, python=s.python if detail else None,
                          env=env_digest(s.key) if detail else None, pss=total, forks=s.forks, spares=len(s.spares),
                          idle=None if s.last_used is None else round(max(0.0, now - s.last_used), 1))


def _user_names(uids: Collection[int]) -> dict[int, str | None]:
    """Blocking (NSS): each uid's name, None where passwd has none."""
    names: dict[int, str | None] = {}
    for uid in uids:
        try:
            names[uid] = pwd.getpwuid(uid).pw_name
        except KeyError:
            names[uid] = None
    return names


class PoolServers:
    """The fork servers of `pool` (None: a daemon without a pool) for `ddpctl daemon`."""

    def __init__(self, pool: WarmPool | None, cache: PssCache | None = None) -> None:
        self.pool = pool
        self.cache = cache or PssCache()

    async def views(self, detail: Detail) -> list[PoolServerView]:
        """Every server, its key and pid where `detail` allows its user's; [] without fork servers."""
        snaps = [] if self.pool is None else self.pool.servers()
        if not snaps:
            return []
        pss = await self.cache.get({pid for s in snaps for pid in (s.pid, *s.spares)})
        names = await anyio.to_thread.run_sync(_user_names, {s.key.uid for s in snaps})
        now = time.monotonic()
        return [server_view(s, pss, names.get(s.key.uid), detail(s.key.uid), now) for s in snaps]
