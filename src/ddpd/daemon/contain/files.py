"""Reading files a job can write (its rank logs): never on the event loop, never blocking for long.

A job controls its own directory: a rank log can become a FIFO, a symlink to /dev/zero or to
another user's file, or a file on a hung filesystem. Every read here opens with O_NONBLOCK and
O_NOFOLLOW, accepts a regular file only, reads a bounded amount, and runs in a worker thread of
its own small limiter with a bounded wait, so one job can neither freeze the loop nor park the
threads that the database and other clients need.

Paths the daemon builds (a log's directory, a backup beside it) are resolved by `open_dir_safely`
through directory fds, one component at a time with O_NOFOLLOW: a symlink is followed only where
nobody but the daemon's user could have planted it (a directory it owns that no group or other
may write), so a job that swaps a directory of its tree for a symlink into another user's tree is
refused (`UnsafeDirectory`), never followed.
"""

from __future__ import annotations

import errno
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


class UnsafeDirectory(OSError):
    """A directory path that goes through a symlink someone other than the daemon's user could plant."""


_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
MAX_LINKS = 40  # trusted symlinks followed on one path (as the kernel's ELOOP bound)


def _trusted(dir_fd: int) -> bool:
    """Only the daemon's user could have made an entry in this directory."""
    st = os.fstat(dir_fd)
    return st.st_uid == os.geteuid() and not st.st_mode & 0o022


def _step(fd: int, part: str, where: str, links: list[int]) -> int:
    """The directory `part` within `fd`: never through a symlink an untrusted user could plant."""
    try:
        return os.open(part, _DIR | os.O_NOFOLLOW, dir_fd=fd)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR) or not _is_link(fd, part):
            raise
        if not _trusted(fd) or len(links) >= MAX_LINKS:
            raise UnsafeDirectory(errno.ELOOP, f"{where}: {part} is a symlink in a directory that not only "
                                               "the daemon's user can write; not followed") from None
        links.append(1)
        target = os.readlink(part, dir_fd=fd)
        return _walk(fd if not target.startswith("/") else None, target, where, links)


def _is_link(fd: int, part: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _walk(start: int | None, path: str, where: str, links: list[int]) -> int:
    fd = os.open("/" if start is None else ".", _DIR, dir_fd=start)
    try:
        for part in (p for p in path.split("/") if p and p != "."):
            nxt = os.open("..", _DIR, dir_fd=fd) if part == ".." else _step(fd, part, where, links)
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_dir_safely(path: str | os.PathLike[str]) -> int:
    """An fd of the directory `path` (absolute), resolved one component at a time (see the module):
    UnsafeDirectory when the way goes through a symlink that a user could have planted."""
    text = os.fspath(path)
    if not text.startswith("/"):
        raise ValueError(f"{text!r} is not an absolute path")
    return _walk(None, text, text, [])


def open_in_dir_safely(path: str | os.PathLike[str], flags: int, mode: int = 0o600) -> int:
    """`os.open(path, flags | O_NOFOLLOW)` with its directory resolved by `open_dir_safely`."""
    p = Path(path)
    dir_fd = open_dir_safely(p.parent)
    try:
        return os.open(p.name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)


def _limit() -> anyio.CapacityLimiter:
    global _limiter
    if _limiter is None:
        _limiter = anyio.CapacityLimiter(4)
    return _limiter


def open_job_file(path: str | Path) -> int:
    """An fd of `path` opened read-only, non-blocking, without following a symlink; regular files only."""
    try:
        fd = open_in_dir_safely(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == 40 and not isinstance(exc, UnsafeDirectory):  # ELOOP: the last component is a symlink
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
