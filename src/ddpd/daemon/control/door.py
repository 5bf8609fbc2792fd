"""The door of every listener the daemon runs: accept loops no error ends, and a per-user budget.

`accept_forever` accepts connections until its listener is closed. An `accept()` that fails (EMFILE
and ENFILE when descriptors run out, ENOBUFS, ENOMEM, or anything else) pauses accepting with an
exponential backoff (ACCEPT_BACKOFF_MIN doubling to ACCEPT_BACKOFF_MAX) and is logged once per
episode (`listener.accept_failed`, then `listener.accept_resumed` with the count): the connections
already open go on being served and their closing frees what the next accept needs. A handler that
raises is logged (`listener.handler_failed`) and ends its connection only. Nothing here raises
into the root task group but cancellation.

`Door` counts the control connections open per peer uid. An unprivileged uid may hold at most
`max_connections_per_user`, and all unprivileged uids together `max_connections` less a reserve
(`reserve_of`); root, the daemon's own uid and the admin group's members (`privileged`, asked only
when a connection would be refused) may use the reserve, so they can always ping and cancel.
"""

from __future__ import annotations

import errno
import os
import socket
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.to_thread
import structlog
from anyio.abc import SocketListener

from ..contain.identity import Identity, UnknownUser, admin_gid

log = structlog.get_logger("ddpd")

ACCEPT_BACKOFF_MIN = 0.05
ACCEPT_BACKOFF_MAX = 2.0
PRIVILEGE_TTL = 60.0  # seconds an admin-group lookup is remembered (a refused flood asks it once)
RESERVE = 8  # connections only root and the admin group may use (at most a quarter of max_connections)


def backoff_after(previous: float) -> float:
    """The next pause after a failed accept: doubling, bounded."""
    return min(ACCEPT_BACKOFF_MAX, max(ACCEPT_BACKOFF_MIN, previous * 2))


async def _guarded(handler: Callable[[Any], Awaitable[None]], stream: Any, name: str) -> None:
    try:
        await handler(stream)
    except Exception:  # a bug in one connection's handler: that connection ends, the listener goes on
        log.exception("listener.handler_failed", listener=name)


async def accept_forever(listener: SocketListener, handler: Callable[[Any], Awaitable[None]], name: str) -> None:
    """Serve `listener` with `handler` (one task per connection) until the listener is closed."""
    failures, pause = 0, 0.0
    async with anyio.create_task_group() as tg:
        while True:
            try:
                stream = await listener.accept()
            except anyio.ClosedResourceError:
                return
            except Exception as exc:  # EMFILE, ENFILE, ENOBUFS, ENOMEM...: pause, never end
                cause = exc.__cause__ if isinstance(exc, anyio.BrokenResourceError) else exc  # anyio wraps OSError
                pause = backoff_after(pause)
                if failures == 0:
                    log.warning("listener.accept_failed", listener=name, error=str(cause), retry_in=pause,
                                errno=errno.errorcode.get(getattr(cause, "errno", None) or 0))
                failures += 1
                await anyio.sleep(pause)
                continue
            if failures:
                log.info("listener.accept_resumed", listener=name, failures=failures)
                failures, pause = 0, 0.0
            tg.start_soon(_guarded, handler, stream, name)


def reserve_of(max_connections: int) -> int:
    return min(RESERVE, max_connections // 4)


class Door:
    """Control connections open per uid, and whether one more may come in (see the module docstring)."""

    def __init__(self) -> None:
        self.open: Counter[int] = Counter()

    @property
    def total(self) -> int:
        return sum(self.open.values())

    def refusal(self, uid: int, privileged: bool, max_connections: int, per_user: int) -> str | None:
        """Why one more connection of `uid` is refused now, or None (then `enter` it)."""
        total = self.total
        if total >= max_connections:
            return f"{max_connections} connections are open (max_connections); try again later"
        if privileged:
            return None
        if self.open[uid] >= per_user:
            return (f"uid {uid} has {self.open[uid]} connections open (max_connections_per_user = {per_user}); "
                    "close some (idle ones, `wait`s, followed logs) and try again")
        if total >= max_connections - reserve_of(max_connections):
            return (f"{total} connections are open; the last {reserve_of(max_connections)} of max_connections "
                    "are kept for root and the admin group; try again later")
        return None

    def enter(self, uid: int) -> None:
        self.open[uid] += 1

    def leave(self, uid: int) -> None:
        self.open[uid] -= 1
        if self.open[uid] <= 0:
            del self.open[uid]


def is_daemon_user(uid: int) -> bool:
    return uid in (0, os.geteuid())


def _in_group(uid: int, group: str) -> bool:
    """Blocking (NSS): whether `uid` is a member of `group`."""
    gid = admin_gid(group)
    try:
        return gid is not None and gid in Identity.of(uid).groups
    except UnknownUser:
        return False


class Privilege:
    """Whether a uid may use the reserve: root, the daemon's own uid, the admin group's members."""

    def __init__(self) -> None:
        self._seen: dict[tuple[int, str], tuple[bool, float]] = {}

    async def of(self, uid: int, admin_group: str | None) -> bool:
        if is_daemon_user(uid):
            return True
        if not admin_group:
            return False
        now = anyio.current_time()
        hit = self._seen.get((uid, admin_group))
        if hit is not None and now - hit[1] < PRIVILEGE_TTL:
            return hit[0]
        member = await anyio.to_thread.run_sync(_in_group, uid, admin_group)
        if len(self._seen) >= 1024:
            self._seen.clear()
        self._seen[(uid, admin_group)] = (member, now)
        return member


async def peer_closed(sock: socket.socket) -> None:
    """Return once the peer closed its end (EOF or reset) while the server is not reading (a `wait`,
    a followed stream); sleep for ever if it sent more instead (a next request: it is read later)."""
    while True:
        await anyio.wait_readable(sock)
        try:
            data = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            continue
        except OSError:
            return
        if not data:
            return
        await anyio.sleep_forever()
