"""Rank log rotation: a rank log over ``rank_log_max`` keeps its newest part, copytruncate style.

A rank writes its log through its own stdout/stderr fd, opened with O_APPEND, so the daemon cannot
rename the file under it. When the live log exceeds the limit, its newest part (half the limit,
starting at a line boundary where one is near) is copied to ``rank-<r>.log.1``, replacing an older
one, and the live file is truncated in place: the rank's next write lands at the new end (offset 0).
What a rank writes between the last size check and the truncation (microseconds: the copy catches
up with the rank a few times first, and the backup is synced after) is lost, as with logrotate's
copytruncate. On disk a rank then holds at most about 1.5 times the limit.

The live log is hostile ground: a job can replace its path by a FIFO, a symlink or another file.
`rotate` works on an fd (opened once by the daemon with `open_live_log`, which is O_NOFOLLOW,
O_NONBLOCK and regular files only; a path is opened the same way) and checks it with fstat, reads
with pread and truncates with ftruncate, so a swapped path cannot redirect it. The ``.1`` file is
made in the log's directory by unlinking whatever has its name
and creating it with O_CREAT|O_EXCL|O_NOFOLLOW: a symlink planted there is removed, never followed,
and a file recreated in between makes the rotation give up (the live log is then not truncated).
The backup takes the live log's mode (and, for a daemon running as root, its owner). That
directory (and a path's) is resolved through directory fds one component at a time
(`files.open_dir_safely`): a rank that swaps its job or attempt directory for a symlink into
another user's tree makes the rotation fail (RotationError), never redirects it there.

`plan` and `line_start` are the pure policy; `rotate` is blocking: `logindex.tick` calls it from the
thread of the attempt's `keeper.LogKeeper` when the log grew, at most once a quarter second (on the
job-file limiter of `files`, with a bounded wait).
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..contain.files import UnsafeDirectory, open_dir_safely, open_in_dir_safely

StrPath = str | os.PathLike[str]
CHUNK = 1 << 20  # bytes copied per pread/write
LINE_SEARCH = 64 * 1024  # how far into the kept part a line boundary is looked for
CATCH_UP = 4  # copies of what the rank wrote meanwhile before the live log is emptied
ROTATE_TIMEOUT = 10.0  # seconds a rotation may take off the loop before it is no longer waited for


class RotationError(OSError):
    """A rotation that could not be done safely (not a regular file, or the backup name was raced)."""


@dataclass(frozen=True)
class Plan:
    """Copy bytes [start, end) of the live log to the backup, then truncate the live log."""

    start: int
    end: int


@dataclass(frozen=True)
class Rotated:
    """What one rotation did: bytes kept in the backup, bytes dropped, and the backup's path."""

    kept: int
    dropped: int
    backup: str


def plan(size: int, max_bytes: int) -> Plan | None:
    """None while `size` is within `max_bytes`; else the newest half of the limit is kept."""
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, not {max_bytes}")
    if size <= max_bytes:
        return None
    keep = max(1, max_bytes // 2)
    return Plan(start=size - keep, end=size)


def line_start(head: bytes) -> int:
    """How many bytes after the cut to skip so that the kept part starts a line. `head` is the live
    log from the byte just before the cut: 0 when that byte ends a line, else up to and including
    the first newline; 0 too when no newline is within LINE_SEARCH bytes or nothing would be left."""
    cut = head.find(b"\n", 0, LINE_SEARCH)
    if cut < 0 or cut + 1 >= len(head):
        return 0
    return cut


def open_live_log(path: StrPath) -> int:
    """An fd of a rank log for rotation: read-write, non-blocking, not through a symlink, regular only."""
    try:
        fd = open_in_dir_safely(path, os.O_RDWR | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP and not isinstance(exc, UnsafeDirectory):
            raise RotationError(exc.errno, f"{path} is a symlink; not followed") from None
        raise
    try:
        _check_regular(fd, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def rotate(log: int | StrPath, max_bytes: int, backup: StrPath | None = None,
           on_cut: Callable[[int, int], None] | None = None) -> Rotated | None:
    """Rotate the live log `log` (an fd the caller keeps, or a path) if it exceeds `max_bytes`.

    `backup` is the ``.1`` path; it defaults to the path with ``.1`` appended and is required with
    an fd. `on_cut(start, end)` is called once the backup holds bytes [start, end) of the live log,
    just before the live log is emptied. Returns None when nothing was due; raises RotationError
    (or OSError) when the rotation cannot be done safely, in which case the live log is left as it was.
    """
    if isinstance(log, int):
        if backup is None:
            raise ValueError("rotating an fd needs the backup path")
        return _rotate_fd(log, max_bytes, Path(backup), str(log), on_cut)
    fd = open_live_log(log)
    try:
        return _rotate_fd(fd, max_bytes, Path(backup if backup is not None else f"{os.fspath(log)}.1"),
                          os.fspath(log), on_cut)
    finally:
        os.close(fd)


def size_of_live(fd: int, name: StrPath) -> int:
    """The size of a live log by its fd (blocking); RotationError when it is not a regular file."""
    return _check_regular(fd, name).st_size


def write_beside(path: StrPath, data: bytes, like: int) -> None:
    """Replace `path` (in a job's directory) by a new file holding `data`, made as the ``.1`` backup
    is (no symlink followed, a racing file gives up) with the mode and owner of the file `like`."""
    st = os.fstat(like)
    out = _create_backup(Path(path))
    try:
        os.fchmod(out, stat.S_IMODE(st.st_mode) & 0o666)
        if os.geteuid() == 0:
            os.fchown(out, st.st_uid, st.st_gid)
        view = memoryview(data)
        while view:
            view = view[os.write(out, view):]
    finally:
        os.close(out)


def _check_regular(fd: int, name: StrPath) -> os.stat_result:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise RotationError(errno.EINVAL, f"{name} is not a regular file")
    return st


def _rotate_fd(fd: int, max_bytes: int, backup: Path, name: str,
               on_cut: Callable[[int, int], None] | None) -> Rotated | None:
    st = _check_regular(fd, name)
    due = plan(st.st_size, max_bytes)
    if due is None:
        return None
    start = due.start + line_start(os.pread(fd, LINE_SEARCH, due.start - 1))  # plan: start >= 1
    out = _create_backup(backup)
    try:
        os.fchmod(out, stat.S_IMODE(st.st_mode) & 0o666)  # readable by whoever may read the live log
        if os.geteuid() == 0:
            os.fchown(out, st.st_uid, st.st_gid)  # a system daemon: the backup is the rank owner's too
        end = _copy(fd, out, start, due.end)
        limit = due.end + max(1, max_bytes // 2)
        for _ in range(CATCH_UP):  # what the rank wrote during the copy, up to another half limit
            grown = _check_regular(fd, name).st_size
            if grown <= end or end >= limit:
                break
            end = _copy(fd, out, end, min(grown, limit))
        if on_cut is not None:
            on_cut(start, end)
        os.ftruncate(fd, 0)  # at once: what the rank writes from the last size check to here is lost
        os.fsync(out)
    finally:
        os.close(out)
    return Rotated(kept=end - start, dropped=start, backup=str(backup))


def _create_backup(backup: Path) -> int:
    """The ``.1`` file, new and empty: whatever had its name (a symlink too) is unlinked first."""
    try:
        dir_fd = open_dir_safely(backup.parent)  # no symlink a job could plant, on the whole way
    except UnsafeDirectory as exc:
        raise RotationError(exc.errno, str(exc)) from None
    try:
        try:
            os.unlink(backup.name, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        except IsADirectoryError:
            raise RotationError(errno.EISDIR, f"{backup} is a directory") from None
        try:
            return os.open(backup.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                           0o644, dir_fd=dir_fd)
        except FileExistsError:
            raise RotationError(errno.EEXIST, f"{backup} was recreated during the rotation") from None
    finally:
        os.close(dir_fd)


def _copy(src: int, dst: int, start: int, end: int) -> int:
    """Copy bytes [start, end) of `src` to the end of `dst`; returns where the copy stopped (a file
    truncated meanwhile stops it early)."""
    offset = start
    while offset < end:
        data = os.pread(src, min(CHUNK, end - offset), offset)
        if not data:
            break
        view = memoryview(data)
        while view:
            view = view[os.write(dst, view):]
        offset += len(data)
    return offset
