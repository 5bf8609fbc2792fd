"""When the daemon saw each part of a rank log: a small index of (end offset, wall time) beside it.

A rank writes its stdout and stderr straight into its files; the daemon is not in the data path.
At each look of the attempt's log keeper (`keeper`: when a log was written to, at most once a
`TICK`, a quarter second), each stream that grew gets one entry appended to ``<log>.idx``: the
size it had and the time it was seen. A line is stamped with the time of the first entry at or
after its end (`stamp`), so a stamp is when the daemon received the line, to within a tick; a line
past the last entry (written since the last look) is stamped with the time it is read. `--since`
starts at the entry before the first one at or after the time (`since_offset`).

Each rotation is also told to the daemon's readers (`Job.log_cuts`: which bytes of the live log
the backup holds) before the live log is emptied, so a follower goes on in the backup where it was.

Bounded: one entry per tick at most, MAX_ENTRIES per file (past that, every other older entry is
dropped: old lines keep a coarser stamp), and a rotation moves the entries of the kept part to
``<log>.1.idx`` (offsets made relative to the backup) and starts the live index over.

The index is in the job's directory, so a job can spoil it: `decode` keeps only entries that go
forward in offset and time, and a reader never trusts more than MAX_INDEX_BYTES of it. The
daemon writes through its own fd (created without following anything), so a path swapped by the
job is never written through.

Entries are 16 bytes: the offset (unsigned 64-bit) and the time (a double), little-endian.
"""

from __future__ import annotations

import bisect
import math
import os
import struct
import threading
from array import array
from dataclasses import dataclass, field

from ..store.records import LogCut
from . import logrotate

TICK = 0.25  # seconds between two size checks of a rank's logs: the resolution of a stamp
RECORD = struct.Struct("<Qd")
MAX_ENTRIES = 8192  # per index file before it is thinned
MAX_INDEX_BYTES = 2 * MAX_ENTRIES * RECORD.size  # what a reader reads of an index at most


@dataclass
class Index:
    """Entries in order: `offsets` nondecreasing, `times` nondecreasing."""

    offsets: array[int] = field(default_factory=lambda: array("Q"))
    times: array[float] = field(default_factory=lambda: array("d"))

    def __len__(self) -> int:
        return len(self.offsets)

    def add(self, offset: int, when: float) -> bool:
        """Append an entry if it goes forward (False: it would not, and was left out)."""
        if not (0 <= offset < 2**64 and math.isfinite(when)):
            return False
        if self.offsets and (offset <= self.offsets[-1] or when < self.times[-1]):
            return False
        self.offsets.append(offset)
        self.times.append(when)
        return True

    def encode(self) -> bytes:
        return b"".join(RECORD.pack(o, t) for o, t in zip(self.offsets, self.times, strict=True))

    def stamp(self, end: int) -> float | None:
        """The time of the first entry at or after `end` (a line's end offset); None past the last."""
        i = bisect.bisect_left(self.offsets, end)
        return self.times[i] if i < len(self.offsets) else None

    def since_offset(self, when: float) -> int:
        """An offset from which every line stamped at or after `when` lies (lines before it may too)."""
        i = bisect.bisect_left(self.times, when)
        if i == 0:
            return 0
        return self.offsets[i - 1] if i <= len(self.offsets) else self.offsets[-1]

    def shifted(self, start: int, end: int) -> Index:
        """The entries within (start, end], made relative to `start` (the part a rotation keeps), with
        one at `end` when none is there (the part the rank wrote since the last tick)."""
        out = Index()
        lo = bisect.bisect_right(self.offsets, start)
        for o, t in zip(self.offsets[lo:], self.times[lo:], strict=True):
            if o > end:
                if not out or out.offsets[-1] < end - start:
                    out.add(end - start, t)
                return out
            out.add(o - start, t)
        return out

    def thinned(self) -> Index:
        """Every other entry of the older half dropped (the newest half kept whole)."""
        half = len(self.offsets) // 2
        keep = list(range(0, half, 2)) + list(range(half, len(self.offsets)))
        out = Index()
        for i in keep:
            out.add(self.offsets[i], self.times[i])
        return out


def decode(data: bytes) -> Index:
    """An index read from a file a job can write: whole records only, those that go forward."""
    out = Index()
    usable = min(len(data), MAX_INDEX_BYTES) // RECORD.size * RECORD.size
    for offset, when in RECORD.iter_unpack(data[:usable]):
        out.add(offset, when)
    return out


def index_path(log: str) -> str:
    return f"{log}.idx"


def backup_path(log: str) -> str:
    return f"{log}.1"


Runs = list[tuple[float, bytes]]


def segments(data: bytes, base: int, index: Index, default: float, final: bool) -> tuple[Runs, int]:
    """Split `data` (a log's bytes from offset `base`) into runs of whole lines that share a stamp.

    Returns the runs and how many bytes of `data` they hold: a last line without its newline is left
    for the next read unless `final`. Lines past the last entry get `default`.
    """
    usable = len(data) if final else data.rfind(b"\n") + 1
    runs: Runs = []
    pos = 0
    i = bisect.bisect_right(index.offsets, base)  # entries at or before `base` stamp nothing here
    while pos < usable:
        if i < len(index) and index.offsets[i] - base < usable:
            cut = data.rfind(b"\n", pos, index.offsets[i] - base) + 1
            if cut > pos:
                runs.append((index.times[i], data[pos:cut]))
                pos = cut
            i += 1
        else:
            runs.append((index.times[i] if i < len(index) else default, data[pos:usable]))
            pos = usable
    return runs, usable


def tail_start(buf: bytes, n: int, at_start: bool) -> int | None:
    """Where the last `n` lines of `buf` begin (a last line without a newline counts). `buf` is the
    end of a file; `at_start`: it is the whole file. None: `buf` holds fewer than `n` whole lines
    and does not start the file (read more)."""
    if n <= 0:
        return len(buf)
    end = len(buf) - 1 if buf.endswith(b"\n") else len(buf)
    for _ in range(n):
        nl = buf.rfind(b"\n", 0, end)
        if nl < 0:
            return 0 if at_start else None
        end = nl
    return end + 1


@dataclass
class LiveStream:
    """The daemon's side of one stream of a rank: its log (a read-write fd of the daemon's own), the
    fd of its index (append), and the index so far (kept in memory, written as it grows)."""

    log: str
    fd: int
    index_fd: int
    cuts: dict[str, LogCut] = field(default_factory=dict)  # where its rotations are told (Job.log_cuts)
    index: Index = field(default_factory=Index)
    size: int = 0

    def close(self) -> None:
        for fd in (self.fd, self.index_fd):
            os.close(fd)


class RankLogs:
    """A rank's live streams and who may close their fds: a tick running in a thread that was no
    longer waited for (cancelled, or stuck on a hung filesystem) still uses them, so `close` leaves
    them to that thread, which closes them when it is done (never a closed fd reused meanwhile)."""

    def __init__(self, streams: list[LiveStream]) -> None:
        self.streams = streams
        self._lock = threading.Lock()
        self._busy = self._closed = False

    def tick_all(self, now: float, max_bytes: int) -> list[tuple[LiveStream, logrotate.Rotated | OSError]]:
        """`tick` on each stream (blocking): what rotated, and the streams that failed (dropped)."""
        with self._lock:
            if self._closed or self._busy:  # closed, or a look left to finish on its own: no second one
                return []
            self._busy = True
        done: list[tuple[LiveStream, logrotate.Rotated | OSError]] = []
        try:
            for stream in list(self.streams):
                try:
                    rotated = tick(stream, now, max_bytes)
                except OSError as exc:
                    self.streams.remove(stream)
                    stream.close()
                    done.append((stream, exc))
                    continue
                if rotated is not None:
                    done.append((stream, rotated))
        finally:
            with self._lock:
                self._busy = False
                if self._closed:
                    self._close()
        return done

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                if not self._busy:
                    self._close()

    def _close(self) -> None:
        for stream in self.streams:
            stream.close()
        self.streams = []


def tick(stream: LiveStream, now: float, max_bytes: int) -> logrotate.Rotated | None:
    """One look at a stream (blocking: call it from a thread): an entry when it grew, a rotation when
    it is past `max_bytes`. Raises OSError (RotationError) when the log is no longer a regular file."""
    size = logrotate.size_of_live(stream.fd, stream.log)
    if size < stream.size:  # the job truncated its own log: its index starts over
        _rewrite(stream, Index())
    if size > stream.size:
        if len(stream.index) >= MAX_ENTRIES:
            _rewrite(stream, stream.index.thinned())
        if stream.index.add(size, now):
            os.write(stream.index_fd, RECORD.pack(size, now))
        stream.size = size
    def cut(start: int, end: int) -> None:  # the backup is whole; the live log is emptied next
        last = stream.cuts.get(stream.log)
        stream.cuts[stream.log] = LogCut(1 if last is None else last.generation + 1, start, end)

    done = logrotate.rotate(stream.fd, max_bytes, backup_path(stream.log), on_cut=cut)
    if done is not None:
        kept = stream.index.shifted(done.dropped, done.dropped + done.kept)
        if not kept or kept.offsets[-1] < done.kept:
            kept.add(done.kept, now)
        logrotate.write_beside(index_path(done.backup), kept.encode(), stream.fd)
        _rewrite(stream, Index())
    return done


def _rewrite(stream: LiveStream, index: Index) -> None:
    os.ftruncate(stream.index_fd, 0)  # O_APPEND: the next write lands at the new end
    data = index.encode()
    view = memoryview(data)
    while view:
        view = view[os.write(stream.index_fd, view):]
    stream.index, stream.size = index, (index.offsets[-1] if index else 0)
