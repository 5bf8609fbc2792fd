"""Riding out a daemon restart: `wait`, `logs -f`, `submit --follow` and `watch` keep going when the
daemon goes away (a routine restart requeues the job, which then goes on).

When the daemon cannot be reached, or hangs up, these commands say so on stderr and try again with
backoff (BACKOFF_FIRST doubling up to BACKOFF_MAX) for at most `--reconnect` seconds
($DDPCTL_RECONNECT, default RECONNECT_DEFAULT; 0: never); once a ping is answered they say so and
go on. Only a daemon that stays away that long ends them with exit 3. An unsafe socket directory is
never retried.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import anyio
import click

from ddpd.client import AsyncClient, Client, DaemonUnavailable, ErrorCode, LogChunk, RemoteError, UnsafeSocket

from .output import note

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")

RECONNECT_DEFAULT = 120.0  # seconds a command waits for a daemon that went away
BACKOFF_FIRST = 0.1
BACKOFF_MAX = 2.0


def reconnect_option(func: F) -> F:
    return click.option(
        "--reconnect", type=click.FloatRange(min=0), default=RECONNECT_DEFAULT, show_default=True,
        envvar="DDPCTL_RECONNECT", show_envvar=True, metavar="SECONDS",
        help="When the daemon goes away (a restart), try again for this long before giving up (exit 3).",
    )(func)


def gone(exc: BaseException) -> bool:
    """Whether `exc` says the daemon is away (not running, restarting, shutting down)."""
    if isinstance(exc, UnsafeSocket):
        return False
    return isinstance(exc, DaemonUnavailable) or (isinstance(exc, RemoteError)
                                                  and exc.code == ErrorCode.SHUTTING_DOWN)


class Away:
    """One spell of the daemon being away: the notes, the backoff and the deadline."""

    def __init__(self, socket_path: Path, window: float, exc: RemoteError) -> None:
        self.socket_path = socket_path
        self.window = window
        self.start = time.monotonic()
        self.delay = BACKOFF_FIRST
        why = exc.reason if isinstance(exc, DaemonUnavailable) else exc.message
        note(f"ddpctl: ddpd at {socket_path} is away ({why}); reconnecting for up to {window:g}s "
             "(--reconnect)", "yellow")

    def next_delay(self, exc: BaseException) -> float:
        """Seconds to wait before the next try; DaemonUnavailable ("still away", exit 3) once the window
        is spent, and a failure other than the daemon being away as it is."""
        if not gone(exc):
            raise exc
        left = self.window - (time.monotonic() - self.start)
        if left <= 0:
            raise DaemonUnavailable(self.socket_path, f"still away after {self.window:g}s (--reconnect)") from None
        delay, self.delay = min(self.delay, left), min(self.delay * 2, BACKOFF_MAX)
        return delay

    def back(self) -> None:
        note(f"ddpctl: reconnected to ddpd after {time.monotonic() - self.start:.1f}s", "green")


def ride_out(client: Client, window: float, exc: RemoteError) -> None:
    """Block until the daemon answers a ping again; re-raise (exit 3) when it stays away `window` s."""
    if window <= 0 or not gone(exc):
        raise exc
    away = Away(client.socket_path, window, exc)
    while True:
        time.sleep(away.next_delay(exc))
        try:
            client.ping()
        except RemoteError as again:
            exc = again
            continue
        away.back()
        return


async def ride_out_async(client: AsyncClient, window: float, exc: RemoteError) -> None:
    """`ride_out` for an AsyncClient."""
    if window <= 0 or not gone(exc):
        raise exc
    away = Away(client.socket_path, window, exc)
    while True:
        await anyio.sleep(away.next_delay(exc))
        try:
            await client.ping()
        except RemoteError as again:
            exc = again
            continue
        away.back()
        return


def retrying(client: Client, window: float, call: Callable[[], T]) -> T:
    """`call()`, called again each time the daemon came back after going away."""
    while True:
        try:
            return call()
        except RemoteError as exc:
            ride_out(client, window, exc)


class Resume:
    """Where a log follow-stream stands, to go on after a reconnect without repeating a line: the
    last stamp seen and the chunks seen with it (asked again from that stamp, those are skipped)."""

    def __init__(self) -> None:
        self.since: float | None = None
        self._at: set[tuple[int, int, str | None, str]] = set()

    def fresh(self, chunk: LogChunk) -> bool:
        """Whether `chunk` is new; records it."""
        if chunk.time is None:
            return True
        key = (chunk.attempt, chunk.rank, chunk.stream, chunk.text)
        if self.since is not None and (chunk.time < self.since or (chunk.time == self.since and key in self._at)):
            return False
        if chunk.time != self.since:
            self.since, self._at = chunk.time, set()
        self._at.add(key)
        return True


def follow_logs(client: Client, window: float, job_id: str, write: Callable[[LogChunk], None],
                **query: Any) -> None:
    """Write the chunks of `client.logs(job_id, follow=True, **query)` until the job ends, going on
    where it stood each time the daemon came back (from the last stamp, without `tail`)."""
    resume = Resume()
    while True:
        try:
            with client.logs(job_id, follow=True, **query) as chunks:
                for chunk in chunks:
                    if resume.fresh(chunk):
                        write(chunk)
            return
        except RemoteError as exc:
            ride_out(client, window, exc)
        query = {**query, "tail": None, "since": resume.since if resume.since is not None else query.get("since")}
