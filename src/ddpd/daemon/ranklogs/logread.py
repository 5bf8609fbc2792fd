"""The `logs` follow-stream: a job's rank logs, both streams or one, a rank set, the last lines of each
rank and/or the lines since a time, ordered by when the daemon received them.

Each (rank, stream) is a `Source`: its rotated part (``<log>.1``) then its live log, read as one
sequence of bytes (a virtual offset: the backup's bytes first), through `files.read_job_file` (no
symlink, regular files only, off the loop with a bounded wait). Every run of lines carries its stamp
from the stream's index (`logindex`). Sources are merged by stamp: a run goes out once no source
that still has unread bytes could hold an earlier one (each source's stamps only go forward), so a
source holds at most one read (LOG_CHUNK) in memory.

Without a rank set, the ranks are those this daemon runs in the attempt (`RanksOf`: a multi-node
job's global ranks on this node, which a follower takes in as they start). `--tail N` starts each
stream at its last N lines (read backwards at most TAIL_BYTES); with both streams, a first pass over
those lines keeps the last N of the merged order. `--since T` starts each stream at the index entry
before the first stamped at or after T and drops the runs stamped before.
Each rotation is told in `Job.log_cuts` before the live log is emptied: a source that sees a new one
after a read drops that read and goes on in the new backup at the bytes it had reached, so a
follower misses nothing of a rotation unless it was more than one rotation behind (then it goes on
at the backup's start). A live log emptied otherwise (by the job, or rotated by an earlier daemon)
is seen as shorter than what was read, and read again from its start.
"""

from __future__ import annotations

import codecs
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import anyio

from ...protocol.control import LogChunk, Logs
from ...protocol.limits import clip_text
from ..contain.files import Opener, job_file_size, read_job_file
from ..layout import stderr_log
from ..store.records import Job, LogCut
from .logindex import MAX_INDEX_BYTES, RECORD, Index, backup_path, decode, index_path, segments
from .logseek import TAIL_BYTES, line_start, line_starts, read_bytes, tail_of

LOG_CHUNK = 128 * 1024  # bytes of a log per read: even escaped 6-fold a chunk stays under the frame limit
FOLLOW_INTERVAL = 0.2
ORDER = {"stdout": 0, "stderr": 1}

PathOf = Callable[[Job, int, int], Path]  # (job, attempt, rank) -> the rank's stdout log
RanksOf = Callable[[int], Awaitable[list[int]]]  # attempt -> the global ranks this daemon runs (or ran) in it
OpenerOf = Callable[[str], Opener | None]  # a path -> how to open it safely (None: files.open_job_file)


@dataclass
class Run:
    stamp: float
    pos: int  # virtual offset of its first byte
    data: bytes


@dataclass
class Source:
    """One stream of one rank: where it is read up to (`pos`, virtual), and what was read but not sent."""

    rank: int
    stream: str
    path: str  # the live log
    opener: Opener | None
    cuts: dict[str, LogCut] = field(default_factory=dict)  # the job's log rotations (Job.log_cuts)
    cut_generation: int = 0  # the rotation its backup is from
    pos: int = 0
    backup_size: int = 0
    backup_index: Index = field(default_factory=Index)
    live_index: Index = field(default_factory=Index)
    index_read: int = 0  # bytes of the live index file taken in
    queue: deque[Run] = field(default_factory=deque)
    caught_up: bool = False
    last_stamp: float = 0.0
    last_read: tuple[int, int] = (-1, -1)  # (offset, length) of the last live read that left a partial line
    decoder: codecs.IncrementalDecoder = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))

    @property
    def key(self) -> tuple[int, int]:
        return self.rank, ORDER[self.stream]

    async def open(self) -> None:
        """Take in the rotated part's size and index (none yet: empty)."""
        self.backup_size = await job_file_size(backup_path(self.path), opener=self.opener)
        self.backup_index = await _index(index_path(backup_path(self.path)), self.opener)
        self.live_index, self.index_read = Index(), 0

    async def refresh_index(self) -> None:
        """Take in the live index's new entries (all of it again when it was rewritten)."""
        path = index_path(self.path)
        size = await job_file_size(path, opener=self.opener)
        if size < self.index_read:
            self.live_index, self.index_read = Index(), 0
        if size <= self.index_read:
            return
        data = await read_bytes(path, self.index_read, min(size - self.index_read, 2 * LOG_CHUNK), self.opener)
        data = data[:len(data) // RECORD.size * RECORD.size]
        self.index_read += len(data)
        for offset, when in RECORD.iter_unpack(data):
            self.live_index.add(offset, when)

    async def read(self, now: float, final: bool) -> list[Run]:
        """The next runs (at most one read's worth); sets `caught_up` when the end was reached."""
        if self.pos < self.backup_size:
            data = await read_bytes(backup_path(self.path), self.pos,
                                    min(LOG_CHUNK, self.backup_size - self.pos), self.opener)
            if await self._rotated(None):
                return []
            if not data:  # the backup shrank (a rotation by an earlier daemon?): go on with the live log
                self.pos = self.backup_size
                return []
            runs, used = segments(data, self.pos, self.backup_index, now, final=True)
            self.caught_up = False
            return self._take(runs, self.pos, used)
        live = self.pos - self.backup_size
        data = await read_bytes(self.path, live, LOG_CHUNK, self.opener)
        if await self._rotated(live):  # what was read may be the emptied log's new start: read again
            return []
        if not data:
            self.caught_up = True
            if live and await job_file_size(self.path, opener=self.opener) < live:
                await self.open()  # rotated (truncated in place): the live log starts over
                self.pos = self.backup_size
                self.caught_up = False
            return []
        if not self.live_index or self.live_index.offsets[-1] < live + len(data):
            await self.refresh_index()
        stale = self.last_read == (live, len(data))  # a partial last line that did not grow since
        self.last_read = (live, len(data))
        endless = len(data) == LOG_CHUNK and b"\n" not in data  # a line longer than a read goes in pieces
        runs, used = segments(data, live, self.live_index, now, final=final or stale or endless)
        self.caught_up = len(data) < LOG_CHUNK
        return self._take(runs, self.pos, used)

    async def _rotated(self, live: int | None) -> bool:
        """After a read: if the log rotated since this source last looked, go on where the rotation
        put what it had not read: in the new backup at the same bytes (`live`, its offset in the live
        log), or at the backup's start when those bytes were dropped (it was reading the old backup,
        or fell more than a rotation behind)."""
        cut = self.cuts.get(self.path)
        if cut is None or cut.generation == self.cut_generation:
            return False
        resume = 0
        if live is not None and cut.generation == self.cut_generation + 1:
            resume = min(max(live - cut.start, 0), cut.end - cut.start)
        self.cut_generation = cut.generation
        await self.open()
        self.pos = min(resume, self.backup_size)
        self.caught_up, self.last_read = False, (-1, -1)
        return True

    def _take(self, runs: list[tuple[float, bytes]], start: int, used: int) -> list[Run]:
        out, pos = [], start
        for stamp, data in runs:
            out.append(Run(stamp, pos, data))
            pos += len(data)
            self.last_stamp = max(self.last_stamp, stamp)
        self.pos = start + used
        return out

    async def seek_tail(self, n: int) -> None:
        """Start at the last `n` lines (of the live log, then of the rotated part when it has fewer)."""
        live_size = await job_file_size(self.path, opener=self.opener)
        offset, found = await tail_of(self.path, live_size, n, self.opener)
        if found >= n or offset > 0 or not self.backup_size:
            self.pos = self.backup_size + offset
            return
        offset, _ = await tail_of(backup_path(self.path), self.backup_size, n - found, self.opener)
        self.pos = offset

    async def seek_since(self, when: float) -> None:
        """Start where lines stamped at or after `when` may begin (never before where it is)."""
        if self.backup_index and self.backup_index.times[-1] >= when:
            at = await line_start(backup_path(self.path), self.backup_index.since_offset(when), self.opener)
        else:
            await self.refresh_index()
            at = self.backup_size + await line_start(self.path, self.live_index.since_offset(when), self.opener)
        self.pos = max(self.pos, at)


async def _index(path: str, opener: Opener | None) -> Index:
    """An index file, or an empty index when it is missing or not safely readable."""
    try:
        return decode(await read_job_file(path, 0, MAX_INDEX_BYTES, opener=opener))
    except OSError:
        return Index()


def sources(job: Job, attempt: int, ranks: Iterable[int], streams: Iterable[str], path_of: PathOf,
            opener_of: OpenerOf) -> list[Source]:
    out = []
    for r in ranks:
        log = str(path_of(job, attempt, r))
        for stream in streams:
            path = log if stream == "stdout" else stderr_log(log)
            cut = job.log_cuts.get(path)
            out.append(Source(rank=r, stream=stream, path=path, opener=opener_of(path), cuts=job.log_cuts,
                              cut_generation=0 if cut is None else cut.generation))
    return out


async def keep_last(group: list[Source], n: int) -> None:
    """Both streams of one rank at their last `n` lines each: move them on so that together they
    hold the last `n` lines of the merged order (read once here, bounded by TAIL_BYTES each)."""
    lines: list[tuple[float, int, int]] = []  # (stamp, stream order, start) of each line
    ends: dict[int, int] = {}
    for order, src in enumerate(group):
        start = src.pos
        while True:
            for run in await src.read(time.time(), final=True):
                lines.extend((run.stamp, order, pos) for pos in line_starts(run.data, run.pos))
            if src.caught_up or src.pos - start >= TAIL_BYTES:
                break
        ends[order] = src.pos
        src.pos, src.caught_up, src.last_stamp, src.last_read = start, False, 0.0, (-1, -1)
    lines.sort(key=lambda x: (x[0], x[1]))
    kept = lines[-n:] if n else []
    for order, src in enumerate(group):
        src.pos = min((pos for _, o, pos in kept if o == order), default=ends[order])


async def log_chunks_of(job: Job, req: Logs, path_of: PathOf, opener_of: OpenerOf,
                        ranks_of: RanksOf) -> AsyncIterator[LogChunk]:
    """The chunks of a `logs` request (`req` checked against the job by the caller): the ranks it
    names, else every rank this daemon runs in the attempt (`ranks_of`); following the current
    attempt, ranks that start later (a multi-node attempt's, once its nodes formed) join the stream."""
    attempt = req.attempt or job.attempt
    asked = req.ranks if req.ranks is not None else [req.rank] if req.rank is not None else None
    streams = ("stdout", "stderr") if req.stream == "both" else (req.stream,)
    first = True
    active: list[Source] = []
    known: set[int] = set()

    async def more() -> list[int]:
        """The attempt's ranks not yet read."""
        wanted = asked if asked is not None else await ranks_of(attempt)
        return sorted(set(wanted) - known)

    while True:
        fresh = sources(job, attempt, await more(), streams, path_of, opener_of)
        known.update(src.rank for src in fresh)
        for src in fresh:
            await src.open()
            if first and req.tail is not None:
                await src.seek_tail(req.tail)
            if req.since is not None:
                await src.seek_since(req.since)
        if first and req.tail is not None and len(streams) == 2:
            for i in range(0, len(fresh), 2):
                await keep_last(fresh[i:i + 2], req.tail)
        first = False
        active.extend(fresh)
        growing = more if req.follow and asked is None and attempt == job.attempt else None
        async for chunk in _drain(job, req, attempt, active, growing, expecting=not known):
            yield chunk
        if req.follow and req.attempt is None and attempt != job.attempt:
            attempt, active, known = job.attempt, [], set()  # the job started (attempt 0 is the queue) or restarted
            continue
        if growing is not None and await more():
            continue
        return


async def _drain(job: Job, req: Logs, attempt: int, active: list[Source],
                 more: Callable[[], Awaitable[list[int]]] | None, expecting: bool) -> AsyncIterator[LogChunk]:
    """Read and send the sources in stamp order until they are read (not following), or until the job
    ended, moved to another attempt or has ranks to read that `more` names (following); `expecting`:
    no rank of the attempt is known yet (a follower waits for them even with no source)."""
    while True:
        done = job.finished.is_set() or attempt != job.attempt
        final = not req.follow or done
        now = time.time()
        for src in list(active):
            if src.queue:
                continue
            try:
                runs = await src.read(now, final)
            except OSError as exc:  # a FIFO, a symlink, a hung read: that stream is left out
                active.remove(src)
                what = "log" if src.stream == "stdout" else "stderr log"
                yield LogChunk(rank=src.rank, attempt=attempt, text="", stream=src.stream,
                               error=clip_text(f"rank {src.rank}'s {what} cannot be read: {exc.strerror or exc}",
                                               2000))
                continue
            src.queue.extend(r for r in runs if req.since is None or r.stamp >= req.since)
        pending = [src.last_stamp for src in active if not src.caught_up]
        watermark = min(pending) if pending else float("inf")
        ready: list[tuple[float, tuple[int, int], int, Run, Source]] = []
        for src in active:
            while src.queue and src.queue[0].stamp <= watermark:
                run = src.queue.popleft()
                ready.append((run.stamp, src.key, run.pos, run, src))
        ready.sort(key=lambda x: (x[0], x[1], x[2]))
        for stamp, _, _, run, src in ready:
            yield LogChunk(rank=src.rank, attempt=attempt, text=src.decoder.decode(run.data), stream=src.stream,
                           time=round(stamp, 3))
        if ready or pending or any(src.queue for src in active):
            continue
        if final or (not active and not expecting) or (req.attempt is None and attempt != job.attempt):
            return
        if more is not None and await more():
            return
        with anyio.move_on_after(FOLLOW_INTERVAL):
            await job.finished.wait()
