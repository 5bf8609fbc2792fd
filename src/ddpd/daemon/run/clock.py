"""Time, injected: the attempt, its deadlines and its teardown read a `Clock`, never `time` directly.

`RealClock` is the system's (monotonic for deadlines, wall time for timestamps). `FakeClock` is
for tests, as trio's MockClock: time stands still until a test advances it, or jumps to the
earliest deadline a task sleeps on (`autojump`), so a 5 s grace costs no real time.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Protocol

import anyio
import anyio.lowlevel


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (deadlines)."""
        ...

    def time(self) -> float:
        """Seconds since the epoch (what is stored and shown)."""
        ...

    async def sleep_until(self, deadline: float) -> None:
        """Return once `monotonic()` has reached `deadline` (at once if it has)."""
        ...


class RealClock:
    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()

    async def sleep_until(self, deadline: float) -> None:
        await anyio.sleep(max(0.0, deadline - time.monotonic()))


class FakeClock:
    """A clock that moves only when told to: `advance(seconds)`; or, with `autojump`, a sleeper
    moves it to its own deadline at once (enough for one sequence of sleeps, as a teardown is)."""

    def __init__(self, start: float = 1000.0, wall: float = 1.7e9, autojump: bool = True) -> None:
        self._now = start
        self._wall_offset = wall - start
        self.autojump = autojump
        self._moved: anyio.Event | None = None  # created in the event loop, by the first waiter

    def monotonic(self) -> float:
        return self._now

    def time(self) -> float:
        return self._now + self._wall_offset

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("time does not go back")
        self._now += seconds
        if self._moved is not None:
            self._moved.set()
            self._moved = None

    async def sleep_until(self, deadline: float) -> None:
        await anyio.lowlevel.checkpoint()
        while self._now < deadline:
            if self.autojump:
                self.advance(deadline - self._now)
                break
            if self._moved is None:
                self._moved = anyio.Event()
            await self._moved.wait()


async def wait_until(clock: Clock, deadline: float, until: Callable[[], Awaitable[None]]) -> bool:
    """Run `until()` until it returns (True) or the clock reaches `deadline` (False)."""
    finished = False

    async def run(scope: anyio.CancelScope) -> None:
        nonlocal finished
        await until()
        finished = True
        scope.cancel()

    async with anyio.create_task_group() as tg:
        tg.start_soon(run, tg.cancel_scope)
        await clock.sleep_until(deadline)
        tg.cancel_scope.cancel()
    return finished
