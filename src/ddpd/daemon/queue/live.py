"""The daemon's current config: one holder, shared by reference.

Every part that reads the config (the scheduler and its runners, history, hooks, the GPU quarantine,
fair share, retention, the control server) holds this one `LiveConfig` and reads `current` when it
needs a value; a reload `replace`s it once and every reader sees the new config at its next read.
No part keeps a `Config` of its own: a copy would keep a stale config silently after a reload (the
fair-share half-life did). A running attempt still keeps the config it started with: it is given
`current` when it starts.
"""

from __future__ import annotations

from ..config import Config


class LiveConfig:
    """The current `Config`; `replace` is the one way a reload changes it."""

    __slots__ = ("_current",)

    def __init__(self, config: Config) -> None:
        self._current = config

    @property
    def current(self) -> Config:
        return self._current

    def replace(self, config: Config) -> None:
        self._current = config
