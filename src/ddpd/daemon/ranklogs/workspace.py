"""An attempt's files in its owner's tree: the attempt and checkpoint directories, each rank's two
logs (stdout ``rank-<r>.log`` and stderr ``rank-<r>.err``, created without following anything a
job may have planted), the daemon's own read-write fds of them with their stamp indexes (see
`logindex`), and the task that keeps them: every `logindex.TICK` it notes how far each stream
grew and rotates one past its limit (off the loop, on the job-file limiter, with a bounded wait),
and once the rank has exited it looks a last time, so that its last lines are stamped too.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import anyio
import anyio.to_thread
import structlog

from ..attempt.ranks import RankHandle
from ..contain import files
from ..contain.identity import Identity
from ..contain.usertree import JOBS_DIR, create_user_file, ensure_base, ensure_dirs
from ..store.journal import Journal
from ..store.records import Job, rank_err_name, rank_log_name
from .logindex import TICK, LiveStream, RankLogs, index_path
from .logrotate import ROTATE_TIMEOUT

log = structlog.get_logger("ddpd")


def prepare_dirs(state_dir: Path, identity: Identity, job_id: str, number: int) -> None:
    """The attempt's directory and the job's checkpoints, its owner's (blocking)."""
    ensure_base(state_dir)
    ensure_dirs(state_dir, identity, JOBS_DIR, job_id, f"attempt-{number}")
    ensure_dirs(state_dir, identity, JOBS_DIR, job_id, "checkpoints")


def create_logs(state_dir: Path, identity: Identity, job_id: str, number: int, rank: int) -> tuple[int, int]:
    """Rank `rank`'s stdout and stderr logs, write fds created in its owner's tree without following
    anything (blocking; the caller closes both)."""
    where = (JOBS_DIR, job_id, f"attempt-{number}")
    out = create_user_file(state_dir, identity, *where, name=rank_log_name(rank))
    try:
        return out, create_user_file(state_dir, identity, *where, name=rank_err_name(rank))
    except BaseException:
        os.close(out)
        raise


def live_streams(state_dir: Path, identity: Identity, job: Job, number: int, paths: list[str],
                 fds: list[int]) -> RankLogs:
    """The daemon's side of each log (`paths[i]` written through `fds[i]`): its own read-write fd and
    an index created beside it, its rotations told in `job.log_cuts` (blocking)."""
    streams: list[LiveStream] = []
    try:
        for path, fd in zip(paths, fds, strict=True):
            rw = reopen_rw(fd)
            try:
                idx = create_user_file(state_dir, identity, JOBS_DIR, job.id, f"attempt-{number}",
                                       name=Path(index_path(path)).name)
            except BaseException:
                os.close(rw)
                raise
            streams.append(LiveStream(log=path, fd=rw, index_fd=idx, cuts=job.log_cuts))
    except BaseException:
        for s in streams:
            s.close()
        raise
    return RankLogs(streams)


def reopen_rw(fd: int) -> int:
    """The same file as `fd` (a write-only rank log), opened again read-write for rotation: through
    /proc/self/fd, so no path the job can swap is involved."""
    return os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)


async def keep_logs(h: RankHandle, max_bytes: int, journal: Journal, job: Job) -> None:
    """Index and rotate the rank's logs every TICK until it has exited; then (also when cancelled: the
    attempt ends as soon as its ranks have) one last look, shielded and bounded, so that the rank's
    last lines are stamped and its logs are within their limit once the job has ended."""
    logs = h.logs
    if logs is None:
        return
    try:
        while logs.streams and not h.exited.is_set():
            with anyio.move_on_after(TICK):
                await h.exited.wait()
            await _look(h, logs, max_bytes, journal, job)
    finally:
        await _look(h, logs, max_bytes, journal, job)


async def _look(h: RankHandle, logs: RankLogs, max_bytes: int, journal: Journal, job: Job) -> None:
    """One look at the rank's logs and its events, shielded (a rotation under way is never abandoned
    by a cancel, nor left untold) and bounded (a hung filesystem is: its fds are then left to the
    thread to close)."""
    if not logs.streams:
        return
    with anyio.CancelScope(shield=True):
        with anyio.move_on_after(ROTATE_TIMEOUT) as waited:
            results = await anyio.to_thread.run_sync(logs.tick_all, time.time(), max_bytes,
                                                     limiter=files._limit(), abandon_on_cancel=True)
        if waited.cancelled_caught:
            log.warning("rank.log_check_stuck", rank=h.rank.rank, seconds=ROTATE_TIMEOUT)
            logs.close()
            return
        for stream, result in results:
            name = "stderr" if stream.log.endswith(".err") else "stdout"
            if isinstance(result, OSError):
                log.warning("rank.log_rotation_failed", rank=h.rank.rank, stream=name, error=str(result))
            else:
                await journal.event(job, "rank.log_rotated", rank=h.rank.rank, stream=name, kept=result.kept,
                                    dropped=result.dropped)
