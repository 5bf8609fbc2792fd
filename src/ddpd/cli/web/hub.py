"""One follow-stream of the daemon's events, shared by every open page.

The hub reads `events --follow` as the user (the daemon leaves out the events of jobs the user may
not see in detail: those jobs' rows refresh on the pages' one-second tick) and keeps the latest
events in a ring. A page remembers its position and waits for the next change: `wait` returns at
once when something is newer, else at the next event, the timeout or the hub's close. When the
stream breaks (the daemon restarted), the hub says so (`error`) and follows again from the last seq.
Closing the hub ends every page's stream, so the server can stop without cutting replies off.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import anyio

from ddpd.client import AsyncClient, AsyncStream, EventView, RemoteError

Wanted = Callable[[EventView], bool]
"""Which events wake a page (the jobs table does not change with a rank's step)."""

RING = 2000  # events kept for pages that fall behind
RETRY = 1.0  # seconds between tries to follow again after the stream broke
START_SCAN = 20  # newest jobs looked at for the seq the stream starts after


class Hub:
    """The shared event stream: a ring of recent events and a change signal."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client
        self._ring: deque[EventView] = deque(maxlen=RING)
        self._count = 0  # events received so far: a page's position
        self._changed = anyio.Event()
        self.last_seq = 0
        self.error: str | None = None
        self.closed = False
        self._scope = anyio.CancelScope()
        self._streams: set[AsyncStream[Any]] = set()

    @property
    def position(self) -> int:
        return self._count

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    def add(self, event: EventView) -> None:
        self._ring.append(event)
        self._count += 1
        self.last_seq = max(self.last_seq, event.seq)
        self._notify()

    def since(self, position: int) -> list[EventView] | None:
        """The events after `position`; None when some of them left the ring already."""
        behind = self._count - position
        if behind > len(self._ring):
            return None
        return list(itertools.islice(self._ring, len(self._ring) - behind, None))

    async def wait(self, position: int, timeout: float, wanted: Wanted = lambda event: True) -> int:
        """The new position once an event `wanted` is newer than `position` (or at the timeout, at
        close, or when the stream broke or came back)."""
        with anyio.move_on_after(timeout):
            while not self.closed:
                news = self.since(position)
                if news is None or any(wanted(e) for e in news):
                    break
                position = self._count
                error = self.error
                await self._changed.wait()
                if self.error != error:
                    break
        return self._count

    def close(self) -> None:
        """End every page's stream and the hub's own `run`."""
        self.closed = True
        self._scope.cancel()
        self._notify()

    async def aclose(self) -> None:
        """`close`, and close the daemon streams pages follow (`following`), so each page's reply ends."""
        self.close()
        for stream in list(self._streams):
            await stream.aclose()

    @contextmanager
    def following(self, stream: AsyncStream[Any]) -> Iterator[AsyncStream[Any]]:
        """`stream` is closed by `aclose` while the block runs."""
        self._streams.add(stream)
        try:
            yield stream
        finally:
            self._streams.discard(stream)

    async def run(self) -> None:
        """Follow the events until closed (or cancelled), again after each break."""
        with self._scope:
            await self._follow()

    async def _follow(self) -> None:
        self.last_seq = await self._start_seq()
        while True:
            try:
                async with self._client.events(None, follow=True, since=self.last_seq) as stream:
                    self.error = None
                    self._notify()
                    async for event in stream:
                        self.add(event)
                self.error = "the daemon ended the event stream"
            except RemoteError as exc:
                self.error = exc.message
            self._notify()
            await anyio.sleep(RETRY)

    async def _start_seq(self) -> int:
        """The seq of the newest event of the newest job the user may see in detail (0: none), so the
        stream starts near now instead of replaying the whole journal."""
        try:
            jobs = await self._client.list_jobs(limit=START_SCAN)
        except RemoteError:
            return 0
        for job in jobs:
            try:
                async with self._client.events(job.id) as stream:
                    last = 0
                    async for event in stream:
                        last = event.seq
                    return last
            except RemoteError:
                continue
        return 0
