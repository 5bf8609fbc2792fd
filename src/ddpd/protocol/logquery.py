"""What a `logs` request may ask, parsed the same way by the client and the daemon: a rank set
("0,2-3"), a start time ("10m", "30s", "2h", "1d", or an ISO-8601 time), the stream, the tail.

Everything is bounded: a rank set names at most MAX_NPROC ranks, each a global rank below MAX_WORLD
(a multi-node job numbers its ranks across its nodes; a range such as "0-1000000" is refused, not
expanded), and a tail asks for at most MAX_TAIL lines.
"""

from __future__ import annotations

import math
import re
from datetime import UTC, datetime
from typing import Literal

from .spec import MAX_NPROC, MAX_WORLD

MAX_TAIL = 100_000  # lines of each rank a `--tail` may ask for
MAX_SPEC = 4096  # characters of a rank set or a time as given
STREAMS = ("stdout", "stderr", "both")
Stream = Literal["stdout", "stderr", "both"]

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_RELATIVE = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")


class QueryError(ValueError):
    """A rank set or a time that cannot be used; the message names the problem."""


def parse_rank_set(text: str, limit: int = MAX_WORLD) -> list[int]:
    """"0,2-3" -> [0, 2, 3]: comma-separated ranks and inclusive ranges, each below `limit`, at most
    MAX_NPROC of them."""
    if len(text) > MAX_SPEC:
        raise QueryError(f"rank set: longer than {MAX_SPEC} characters")
    ranks: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            raise QueryError(f"rank set {text!r}: an empty item")
        lo_text, dash, hi_text = part.partition("-")
        try:
            lo = int(lo_text)
            hi = int(hi_text) if dash else lo
        except ValueError:
            raise QueryError(f"rank set {text!r}: {part!r} is not a rank or a range a-b") from None
        if lo < 0 or hi < 0:
            raise QueryError(f"rank set {text!r}: ranks are not negative")
        if hi < lo:
            raise QueryError(f"rank set {text!r}: range {part!r} runs backwards")
        if hi >= limit:
            raise QueryError(f"rank set {text!r}: rank {hi} is out of range (below {limit})")
        if hi - lo >= MAX_NPROC or len(ranks.union(range(lo, hi + 1))) > MAX_NPROC:
            raise QueryError(f"rank set {text!r}: more than {MAX_NPROC} ranks")
        ranks.update(range(lo, hi + 1))
    return sorted(ranks)


def parse_since(text: str, now: float) -> float:
    """A start time as seconds since the epoch: `now` less a duration ("90s", "10m", "2h", "1d"), or
    an ISO-8601 time (one without a zone is local time)."""
    text = text.strip()
    if len(text) > MAX_SPEC:
        raise QueryError(f"since: longer than {MAX_SPEC} characters")
    if match := _RELATIVE.match(text):
        seconds = float(match.group(1)) * _UNITS[match.group(2)]
        if not math.isfinite(seconds):
            raise QueryError(f"since {text!r}: too long ago")
        return now - seconds
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise QueryError(f"since {text!r}: not a duration (30s, 10m, 2h, 1d) or an ISO-8601 time") from None
    if when.tzinfo is None:
        when = when.astimezone()  # local time, as a user typed it
    return when.timestamp()


def format_stamp(when: float) -> str:
    """An ISO-8601 UTC stamp with milliseconds: 2026-12-03T17:35:44.250Z."""
    return datetime.fromtimestamp(when, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
