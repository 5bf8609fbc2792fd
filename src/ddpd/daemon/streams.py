"""The follow-streams of the control socket: a job's rank logs and the event journal.

Logs are read through `files.read_job_file` (non-blocking, no symlinks, regular files only, off
the loop with a bounded wait): a rank log that became a FIFO or a symlink yields one chunk with
`error` set and the stream goes on without that rank. Events come from the database in batches,
then (following) from the live bus.
"""

from __future__ import annotations

import codecs
from collections.abc import AsyncIterator
from pathlib import Path

import anyio

from ..protocol.control import Events, EventView, LogChunk, Logs
from ..protocol.limits import clip_text
from .files import job_file_size, read_job_file
from .journal import Journal
from .records import Job, rank_log, rank_log_name, user_attempt_dir
from .usertree import reader_for

LOG_CHUNK = 128 * 1024  # bytes of a log per item: even escaped 6-fold it stays under the frame limit
FOLLOW_INTERVAL = 0.2
EVENT_BATCH = 500


def log_path(state_dir: Path, job: Job, attempt: int, rank: int) -> Path:
    """Where rank `rank` of `attempt` logged: its owner's tree, or (jobs from before it) the old place."""
    legacy = rank_log(state_dir, job.id, attempt, rank)
    if legacy.parent.is_dir():  # the daemon's own directory: no job can plant anything there
        return legacy
    return user_attempt_dir(state_dir, job.owner_uid, job.id, attempt) / rank_log_name(rank)


def _decoders(ranks: list[int]) -> dict[int, codecs.IncrementalDecoder]:
    return {r: codecs.getincrementaldecoder("utf-8")("replace") for r in ranks}


async def log_chunks(state_dir: Path, job: Job, req: Logs) -> AsyncIterator[LogChunk]:
    """New text of the job's rank logs (one rank, or all), following the job's attempts with `follow`."""
    attempt = req.attempt or job.attempt
    ranks = [req.rank] if req.rank is not None else list(range(job.spec.nproc))
    offsets = dict.fromkeys(ranks, 0)
    decoders = _decoders(ranks)
    while True:
        done = job.finished.is_set() or (attempt != job.attempt)
        got = False
        for r in list(offsets):
            path = log_path(state_dir, job, attempt, r)
            try:
                data = await read_job_file(path, offsets[r], LOG_CHUNK,
                                           opener=reader_for(state_dir, job.owner_uid, path))
            except FileNotFoundError:
                continue
            except OSError as exc:  # a FIFO, a symlink, a hung read: that rank's log is left out
                del offsets[r]
                yield LogChunk(rank=r, attempt=attempt, text="",
                               error=clip_text(f"rank {r}'s log cannot be read: {exc.strerror or exc}", 2000))
                continue
            if not data and offsets[r] and await job_file_size(
                    path, opener=reader_for(state_dir, job.owner_uid, path)) < offsets[r]:
                offsets[r] = 0  # rotated (truncated in place): the live log starts over
                continue
            if data:
                got = True
                offsets[r] += len(data)
                yield LogChunk(rank=r, attempt=attempt, text=decoders[r].decode(data))
        if got:
            continue
        if req.follow and req.attempt is None and attempt != job.attempt:
            # the job started (attempt 0 is the queue) or restarted: follow its new attempt
            attempt = job.attempt
            offsets = dict.fromkeys(ranks, 0)
            decoders = _decoders(ranks)
            continue
        if not req.follow or done or not offsets:
            return
        with anyio.move_on_after(FOLLOW_INTERVAL):
            await job.finished.wait()


async def job_events(journal: Journal, job: Job | None, req: Events) -> AsyncIterator[EventView]:
    """Events after `req.since` (of one job, or all), at most `req.limit`; then live ones with `follow`."""
    live = journal.bus.subscribe() if req.follow else None
    wanted = None if req.follow else req.limit
    try:
        last, sent = req.since, 0
        while wanted is None or sent < wanted:
            batch = EVENT_BATCH if wanted is None else min(EVENT_BATCH, wanted - sent)
            events = await journal.list_events(None if job is None else job.id, last, batch)
            for event in events:
                last = event.seq
                sent += 1
                yield event
            if len(events) < batch:
                break
        if live is None or (job is not None and job.finished.is_set()):
            return
        async with live:
            async for event in live:
                if event.seq and event.seq <= last:
                    continue
                if job is not None and event.job_id != job.id:
                    continue
                yield event
                if job is not None and event.kind == "job.finished":
                    return
    finally:
        if live is not None:
            live.close()
