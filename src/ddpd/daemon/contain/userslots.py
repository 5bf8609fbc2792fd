"""Each user's share of a kind of helper process (interpreter checks, path checks): at most `per_user`
at once per uid; waiting for one of a uid's slots holds no other uid's. A uid's limiter exists only
while it has checks running or waiting."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable

import anyio


class UserSlots:
    def __init__(self, per_user: Callable[[], int]) -> None:
        self._per_user = per_user  # read at each slot: a reload changes it
        self._users: dict[int, anyio.CapacityLimiter] = {}

    @contextlib.asynccontextmanager
    async def slot(self, uid: int) -> AsyncIterator[None]:
        """One of `uid`'s slots, for the block."""
        mine = self._users.setdefault(uid, anyio.CapacityLimiter(1))
        mine.total_tokens = max(1, self._per_user())
        try:
            async with mine:
                yield
        finally:
            stats = mine.statistics()
            if not stats.borrowed_tokens and not stats.tasks_waiting:
                self._users.pop(uid, None)
