"""The state directory's layout: every name under it is spelled here and nowhere else.

    <state_dir>/ddpd.db                                 the state database (store.state), root's 0600
    <state_dir>/ddpd.db-wal, ddpd.db-shm                SQLite's WAL and shared memory, the same
    <state_dir>/pool.log                                the daemon's own warm workers' output
    <state_dir>/users/<uid>/jobs/<job>/                 a job's files, its owner's (contain.usertree)
        attempt-<n>/rank-<r>.log                        rank r's stdout (ranklogs)
        attempt-<n>/rank-<r>.err                        its stderr: tracebacks, faulthandler's stacks
        attempt-<n>/rank-<r>-error.json                 a script rank's error file (torchrun's)
        checkpoints/                                    the job's checkpoints
    <state_dir>/jobs/<job>/attempt-<n>/rank-<r>.log     where jobs of older daemons logged (legacy_*)

Names and paths only: nothing here opens a file. What creates and opens them in a user's tree
(without following links, as that user) is `contain.usertree`'s.
"""

from __future__ import annotations

from pathlib import Path

DATABASE = "ddpd.db"
POOL_LOG = "pool.log"
USERS_DIR = "users"
JOBS_DIR = "jobs"
CHECKPOINTS_DIR = "checkpoints"


def database(state_dir: Path) -> Path:
    return state_dir / DATABASE


def daemon_files(state_dir: Path) -> list[Path]:
    """The daemon's own files at the top of the state directory: its user's alone (store.private)."""
    db = database(state_dir)
    return [db, db.with_name(f"{DATABASE}-wal"), db.with_name(f"{DATABASE}-shm"), state_dir / POOL_LOG]


def attempt_name(attempt: int) -> str:
    return f"attempt-{attempt}"


def user_job_dir(state_dir: str | Path, uid: int, job_id: str) -> Path:
    """`<state_dir>/users/<uid>/jobs/<job>`: the job's files, its owner's (see usertree)."""
    return Path(state_dir, USERS_DIR, str(uid), JOBS_DIR, job_id)


def user_attempt_dir(state_dir: str | Path, uid: int, job_id: str, attempt: int) -> Path:
    return user_job_dir(state_dir, uid, job_id) / attempt_name(attempt)


def checkpoint_dir(state_dir: str | Path, uid: int, job_id: str) -> Path:
    return user_job_dir(state_dir, uid, job_id) / CHECKPOINTS_DIR


def legacy_job_dir(state_dir: str | Path, job_id: str) -> Path:
    """Where jobs kept their files before the per-user tree (rows recovered from older daemons)."""
    return Path(state_dir, JOBS_DIR, job_id)


def legacy_attempt_dir(state_dir: str | Path, job_id: str, attempt: int) -> Path:
    return legacy_job_dir(state_dir, job_id) / attempt_name(attempt)


def legacy_rank_log(state_dir: str | Path, job_id: str, attempt: int, rank: int) -> Path:
    """Where a rank's stdout and stderr went before the per-user tree."""
    return legacy_attempt_dir(state_dir, job_id, attempt) / rank_log_name(rank)


def rank_log_name(rank: int) -> str:
    """A rank's stdout (before the split of its streams, its stdout and stderr together)."""
    return f"rank-{rank}.log"


def rank_err_name(rank: int) -> str:
    """A rank's stderr: faulthandler's stack dumps and tracebacks go there."""
    return f"rank-{rank}.err"


def rank_error_file_name(rank: int) -> str:
    """A script rank's error file (torchrun's TORCHELASTIC_ERROR_FILE): its exception, as JSON."""
    return f"rank-{rank}-error.json"


def stderr_log(log: str) -> str:
    """The stderr file beside the rank log `log` (``rank-<r>.log`` -> ``rank-<r>.err``)."""
    return log.removesuffix(".log") + ".err"
