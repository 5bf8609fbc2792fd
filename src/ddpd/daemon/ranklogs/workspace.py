"""An attempt's files in its owner's tree: the attempt and checkpoint directories, each rank's two
logs (stdout ``rank-<r>.log`` and stderr ``rank-<r>.err``, created without following anything a
job may have planted), and the daemon's own read-write fds of them with their stamp indexes (see
`logindex`); `keeper` looks at them when they grow.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..contain.identity import Identity
from ..contain.usertree import create_user_file, ensure_base, ensure_dirs
from ..layout import CHECKPOINTS_DIR, JOBS_DIR, attempt_name, rank_err_name, rank_log_name
from ..store.records import Job
from .logindex import LiveStream, RankLogs, index_path


def prepare_dirs(state_dir: Path, identity: Identity, job_id: str, number: int) -> None:
    """The attempt's directory and the job's checkpoints, its owner's (blocking)."""
    ensure_base(state_dir)
    ensure_dirs(state_dir, identity, JOBS_DIR, job_id, attempt_name(number))
    ensure_dirs(state_dir, identity, JOBS_DIR, job_id, CHECKPOINTS_DIR)


def create_logs(state_dir: Path, identity: Identity, job_id: str, number: int, rank: int) -> tuple[int, int]:
    """Rank `rank`'s stdout and stderr logs, write fds created in its owner's tree without following
    anything (blocking; the caller closes both)."""
    where = (JOBS_DIR, job_id, attempt_name(number))
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
                idx = create_user_file(state_dir, identity, JOBS_DIR, job.id, attempt_name(number),
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
