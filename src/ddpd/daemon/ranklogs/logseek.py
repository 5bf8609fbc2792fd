"""Where a `logs` query starts in one log file: the start of its last N lines (`tail_of`, read
backwards at most TAIL_BYTES), the start of the line around an offset (`line_start`), and the
safe read both use (`read_bytes`: through `files.read_job_file`, a missing file reads as empty).
"""

from __future__ import annotations

from ..contain.files import Opener, read_job_file
from .logindex import tail_start

TAIL_BYTES = 16 << 20  # bytes of each stream a tail looks back at most
LINE_BACK = 64 * 1024  # bytes before a `since` offset searched for the start of its line


async def read_bytes(path: str, offset: int, limit: int, opener: Opener | None) -> bytes:
    """At most `limit` bytes of a job's file from `offset`; nothing when the file is missing."""
    try:
        return await read_job_file(path, offset, limit, opener=opener)
    except FileNotFoundError:
        return b""


async def tail_of(path: str, size: int, n: int, opener: Opener | None) -> tuple[int, int]:
    """Where the last `n` lines of a file of `size` bytes begin, and how many lines that is (fewer
    than `n` when the file holds fewer, or TAIL_BYTES holds fewer)."""
    window = min(size, 64 * 1024)
    while True:
        start = size - window
        data = await read_bytes(path, start, window, opener)
        at = tail_start(data, n, at_start=start == 0)
        if at is not None:
            return start + at, min(n, data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0))
        if start == 0 or window >= TAIL_BYTES:
            cut = data.find(b"\n") + 1 if start else 0
            return start + cut, data.count(b"\n", cut) + (1 if data and not data.endswith(b"\n") else 0)
        window = min(size, window * 4, TAIL_BYTES)


async def line_start(path: str, offset: int, opener: Opener | None) -> int:
    """The start of the line that holds byte `offset`: just after the newline before it (looked for
    at most LINE_BACK bytes back; none there: `offset` itself)."""
    if offset <= 0:
        return 0
    back = max(0, offset - LINE_BACK)
    data = await read_bytes(path, back, offset - back, opener)
    nl = data.rfind(b"\n")
    return back + nl + 1 if nl >= 0 or back == 0 else offset


def line_starts(data: bytes, base: int) -> list[int]:
    """The offsets at which the lines of `data` (from offset `base`) start."""
    starts, at = [], 0
    while at < len(data):
        starts.append(base + at)
        nl = data.find(b"\n", at)
        at = len(data) if nl < 0 else nl + 1
    return starts
