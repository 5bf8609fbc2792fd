"""An attempt's files in its owner's tree: the attempt and checkpoint directories, each rank's log
(created without following anything a job may have planted), the daemon's own read-write fd of a
log, and the loop that keeps a log under `rank_log_max`.

The blocking functions run in a worker thread (`anyio.to_thread`); the loop waits on the rank's
`log_tick` (set by its frame reader on heartbeats, at most once a second) and rotates off the loop.
"""

from __future__ import annotations

import os
from pathlib import Path

import anyio
import structlog

from .identity import Identity
from .journal import Journal
from .logrotate import rotate_in_thread
from .ranks import RankHandle
from .records import Job, rank_log_name
from .usertree import JOBS_DIR, create_user_file, ensure_base, ensure_dirs

log = structlog.get_logger("ddpd")


def prepare_dirs(state_dir: Path, identity: Identity, job_id: str, number: int) -> None:
    """The attempt's directory and the job's checkpoints, its owner's (blocking)."""
    ensure_base(state_dir)
    ensure_dirs(state_dir, identity, JOBS_DIR, job_id, f"attempt-{number}")
    ensure_dirs(state_dir, identity, JOBS_DIR, job_id, "checkpoints")


def create_log(state_dir: Path, identity: Identity, job_id: str, number: int, rank: int) -> int:
    """Rank `rank`'s log, a write fd created in its owner's tree without following anything (blocking)."""
    return create_user_file(state_dir, identity, JOBS_DIR, job_id, f"attempt-{number}", name=rank_log_name(rank))


def reopen_rw(fd: int) -> int:
    """The same file as `fd` (a write-only rank log), opened again read-write for rotation: through
    /proc/self/fd, so no path the job can swap is involved."""
    return os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)


async def keep_rotated(h: RankHandle, max_bytes: int, journal: Journal, job: Job, scope: anyio.CancelScope) -> None:
    """Rotate the rank's log whenever a check is due and it is past `max_bytes`; ends when `scope` is
    cancelled (the rank's reader is done) or the log cannot be rotated safely."""
    with scope:
        while h.log_fd is not None:
            await h.log_tick.wait()
            h.log_tick = anyio.Event()
            try:
                done = await rotate_in_thread(h.log_fd, max_bytes, f"{h.rank.log}.1")
            except OSError as exc:
                log.warning("rank.log_rotation_failed", rank=h.rank.rank, error=str(exc))
                return
            if done is not None:
                await journal.event(job, "rank.log_rotated", rank=h.rank.rank, kept=done.kept, dropped=done.dropped)
