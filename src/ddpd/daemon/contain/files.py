"""Reading files a job can write (its rank logs): never on the event loop, never blocking for long.

A job controls its own directory: a rank log can become a FIFO, a symlink to /dev/zero or to
another user's file, or a file on a hung filesystem. Every read here opens with O_NONBLOCK and
O_NOFOLLOW, accepts a regular file only, reads a bounded amount, and runs in a worker thread of
its own small limiter with a bounded wait, so one job can neither freeze the loop nor park the
threads that the database and other clients need.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

import anyio
import anyio.to_thread

READ_TIMEOUT = 2.0  # seconds a read may take before it is abandoned (the thread is left to finish)
_limiter: anyio.CapacityLimiter | None = None


class JobFileError(OSError):
    """A job file that cannot be read safely (not a regular file, a symlink, or too slow)."""


def _limit() -> anyio.CapacityLimiter:
    global _limiter
    if _limiter is None:
        _limiter = anyio.CapacityLimiter(4)
    return _limiter


def open_job_file(path: str | Path) -> int:
    """An fd of `path` opened read-only, non-blocking, without following a symlink; regular files only."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == 40:  # ELOOP: the last component is a symlink
            raise JobFileError(exc.errno, f"{path} is a symlink; not followed") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise JobFileError(0, f"{path} is not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd


Opener = Callable[[str | Path], int]  # opens a job file read-only, safely (open_job_file, or the user tree's)


def read_at(path: str | Path, offset: int, limit: int, opener: Opener | None = None) -> bytes:
    """At most `limit` bytes of `path` from `offset` (blocking: call it from a thread)."""
    fd = (opener or open_job_file)(path)
    try:
        return os.pread(fd, limit, offset)
    finally:
        os.close(fd)


def size_of(path: str | Path, opener: Opener | None = None) -> int:
    """The size of a regular job file; 0 when it is missing or not safely readable."""
    try:
        fd = (opener or open_job_file)(path)
    except OSError:
        return 0
    try:
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


async def read_job_file(path: str | Path, offset: int, limit: int, timeout: float = READ_TIMEOUT,
                        opener: Opener | None = None) -> bytes:
    """`read_at` off the loop with a bounded wait; raises JobFileError when the read takes too long."""
    with anyio.move_on_after(timeout):
        return await anyio.to_thread.run_sync(read_at, path, offset, limit, opener, limiter=_limit(),
                                              abandon_on_cancel=True)
    raise JobFileError(0, f"reading {path} took more than {timeout:.0f}s")


async def job_file_size(path: str | Path, timeout: float = READ_TIMEOUT, opener: Opener | None = None) -> int:
    with anyio.move_on_after(timeout):
        return await anyio.to_thread.run_sync(size_of, path, opener, limiter=_limit(), abandon_on_cancel=True)
    return 0
