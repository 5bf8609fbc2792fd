"""The follow-streams of the control socket: a job's rank logs and the event journal.

Logs are read by `logread`, through `files.read_job_file` (non-blocking, no symlinks, regular
files only, off the loop with a bounded wait): a rank log that became a FIFO or a symlink yields
one chunk with `error` set and the stream goes on without it. Events come from the database in batches,
then (following) from the live bus.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from pathlib import Path

from ...protocol.control import Events, EventView, LogChunk, Logs
from ..contain.usertree import reader_for
from ..layout import legacy_rank_log, rank_log_name, user_attempt_dir
from ..ranklogs.logread import RanksOf, log_chunks_of
from ..store.journal import Journal
from ..store.records import Job

EVENT_BATCH = 500


def log_path(state_dir: Path, job: Job, attempt: int, rank: int) -> Path:
    """Where rank `rank` of `attempt` logged: its owner's tree, or (jobs from before it) the old place."""
    legacy = legacy_rank_log(state_dir, job.id, attempt, rank)
    if legacy.parent.is_dir():  # the daemon's own directory: no job can plant anything there
        return legacy
    return user_attempt_dir(state_dir, job.owner_uid, job.id, attempt) / rank_log_name(rank)


async def log_chunks(state_dir: Path, job: Job, req: Logs, ranks_of: RanksOf) -> AsyncIterator[LogChunk]:
    """The job's rank logs as `req` asks (see `logread`), following its attempts with `follow`;
    `ranks_of`: the global ranks this daemon runs in an attempt (all of them, unless `req` names some)."""
    async for chunk in log_chunks_of(job, req, functools.partial(log_path, state_dir),
                                     functools.partial(reader_for, state_dir, job.owner_uid), ranks_of):
        yield chunk


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
