"""The per-user state tree: `<state_dir>/users/<uid>/jobs/<job>/attempt-<n>/...`, each user's own.

Layout and modes (a root daemon):

    <state_dir>/                 root, 0711   ddpd.db and the daemon's own files live here, 0600/0700
    <state_dir>/users/           root, 0711   traversable, not listable: no one learns who else has jobs
    <state_dir>/users/<uid>/     uid,  0700   the user's; no one else can read anything below
    .../<uid>/jobs/<job>/...     uid,  0700   rank logs, checkpoints, attempt directories

Everything below `users/<uid>` is in the user's hands (the user owns that directory and can plant
symlinks, FIFOs or swap directories at any time), so the daemon, running as root, walks it one
component at a time with `openat(O_NOFOLLOW | O_DIRECTORY)`, creates with `mkdirat` (which never
follows a final symlink), checks every directory it is about to use with `fstat` on the open fd
(a directory, owned by the user or just created by root), and hands ownership over with `fchown`
on that fd, never by path. A symlink anywhere on the way is refused with `UnsafePath`.

A daemon that is not root keeps the same layout with its own uid (chown is then a no-op).

All functions block (file system): call them via anyio.to_thread.
"""

from __future__ import annotations

import functools
import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

from ..layout import JOBS_DIR, USERS_DIR
from .identity import Identity

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
BASE_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC  # the state directory is the admin's: may be a link
FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_ELOOP = 40
_ENOTDIR = 20
_ENXIO = 6


class UnsafePath(OSError):
    """A path in a user's tree that is not what the daemon created (a symlink, a foreign owner...)."""


def _name(part: str) -> str:
    if not part or part in (".", "..") or "/" in part or "\0" in part:
        raise UnsafePath(f"{part!r} is not a single path component")
    return part


def _open_dir(parent_fd: int, name: str, where: str) -> int:
    try:
        return os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    except OSError as exc:
        if exc.errno in (_ELOOP, _ENOTDIR):
            raise UnsafePath(exc.errno, f"{where} is a symlink or not a directory; not followed") from None
        raise


def _make_dir(parent_fd: int, name: str, where: str, uid: int, gid: int, mode: int) -> int:
    """mkdirat + openat(O_NOFOLLOW) + fstat check + fchown/fchmod on the fd; returns the open fd."""
    name = _name(name)
    created = True
    try:
        os.mkdir(name, 0o700, dir_fd=parent_fd)
    except FileExistsError:
        created = False
    fd = _open_dir(parent_fd, name, where)
    try:
        st = os.fstat(fd)
        if not stat.S_ISDIR(st.st_mode):  # pragma: no cover - O_DIRECTORY already refuses
            raise UnsafePath(f"{where} is not a directory")
        if not created and st.st_uid not in (uid, os.geteuid()):
            raise UnsafePath(f"{where} belongs to uid {st.st_uid}, not {uid}; refused")
        if os.geteuid() == 0 and (st.st_uid, st.st_gid) != (uid, gid):
            os.fchown(fd, uid, gid)
        if stat.S_IMODE(st.st_mode) != mode:
            os.fchmod(fd, mode)
        return fd
    except BaseException:
        os.close(fd)
        raise


def ensure_base(state_dir: str | Path) -> None:
    """`<state_dir>` and `<state_dir>/users`, root's, 0711 (traversable only)."""
    os.makedirs(state_dir, mode=0o711, exist_ok=True)
    base = os.open(state_dir, BASE_FLAGS)
    try:
        os.fchmod(base, 0o711)
        os.close(_make_dir(base, USERS_DIR, f"{state_dir}/{USERS_DIR}", os.geteuid(), os.getegid(), 0o711))
    finally:
        os.close(base)


def open_user_dir(state_dir: str | Path, identity: Identity) -> int:
    """An fd of `<state_dir>/users/<uid>`, created if needed, the user's, 0700."""
    users = _open_users(state_dir)
    try:
        where = f"{state_dir}/{USERS_DIR}/{identity.uid}"
        return _make_dir(users, str(identity.uid), where, identity.uid, identity.gid, 0o700)
    finally:
        os.close(users)


def _open_users(state_dir: str | Path) -> int:
    base = os.open(state_dir, BASE_FLAGS)
    try:
        users = _open_dir(base, USERS_DIR, f"{state_dir}/{USERS_DIR}")
    finally:
        os.close(base)
    st = os.fstat(users)
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        os.close(users)
        raise UnsafePath(f"{state_dir}/{USERS_DIR} must be the daemon's and not group/other-writable")
    return users


def _walk(state_dir: str | Path, identity: Identity, parts: tuple[str, ...]) -> tuple[int, Path]:
    fd = open_user_dir(state_dir, identity)
    where = Path(state_dir, USERS_DIR, str(identity.uid))
    try:
        for part in parts:
            where = where / _name(part)
            nxt = _make_dir(fd, part, str(where), identity.uid, identity.gid, 0o700)
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd, where


def ensure_dirs(state_dir: str | Path, identity: Identity, *parts: str) -> Path:
    """Create `<state_dir>/users/<uid>/<parts...>` safely (each the user's, 0700); returns its path.

    For example `ensure_dirs(state, who, "jobs", job_id, "attempt-1")`. Raises `UnsafePath` when
    the user planted a symlink or a foreign directory on the way.
    """
    fd, where = _walk(state_dir, identity, parts)
    os.close(fd)
    return where


def ensure_job_dir(state_dir: str | Path, identity: Identity, job_id: str) -> Path:
    """`<state_dir>/users/<uid>/jobs/<job_id>`, created safely."""
    return ensure_dirs(state_dir, identity, JOBS_DIR, job_id)


def create_user_file(state_dir: str | Path, identity: Identity, *parts: str, name: str) -> int:
    """A write fd (O_APPEND) of `<user dir>/<parts...>/<name>`, the user's, 0600; a regular file only.

    For rank logs the daemon opens and passes as a rank's stdout/stderr: never follows a symlink,
    never blocks on a planted FIFO (O_NONBLOCK, cleared once the file is known to be regular),
    never appends to a hard link of someone else's file.
    """
    fd, where = _walk(state_dir, identity, parts)
    try:
        out = os.open(_name(name), FILE_FLAGS, 0o600, dir_fd=fd)
    except OSError as exc:
        if exc.errno == _ELOOP:
            raise UnsafePath(exc.errno, f"{where / name} is a symlink; not followed") from None
        if exc.errno == _ENXIO:  # a FIFO nobody reads (O_NONBLOCK|O_WRONLY)
            raise UnsafePath(exc.errno, f"{where / name} is not a regular file; refused") from None
        raise
    finally:
        os.close(fd)
    try:
        st = os.fstat(out)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePath(f"{where / name} is not a regular file; refused")
        if st.st_uid not in (identity.uid, os.geteuid()) or st.st_nlink != 1:
            raise UnsafePath(f"{where / name} is not the user's own single-link file; refused")
        if os.geteuid() == 0 and st.st_uid != identity.uid:
            os.fchown(out, identity.uid, identity.gid)
        os.set_blocking(out, True)
        return out
    except BaseException:
        os.close(out)
        raise


def open_user_file(state_dir: str | Path, uid: int, path: str | Path) -> int:
    """A read fd (non-blocking) of `path`, a regular file inside `<state_dir>/users/<uid>/`.

    For the daemon reading what a job wrote (rank logs): every component below the users
    directory is opened with O_NOFOLLOW, so a directory the user swapped for a symlink (to another
    user's tree, say) is refused (`UnsafePath`), never followed. FileNotFoundError if missing.
    """
    top = Path(state_dir, USERS_DIR, str(uid))
    try:
        rel = Path(path).relative_to(top)
    except ValueError:
        raise UnsafePath(f"{path} is not in {top}") from None
    if not rel.parts:
        raise UnsafePath(f"{path} is not a file in {top}")
    fd = _open_users(state_dir)
    where = Path(state_dir, USERS_DIR)
    try:
        for part in (str(uid), *rel.parts[:-1]):
            where = where / _name(part)
            nxt = _open_dir(fd, part, str(where))
            os.close(fd)
            fd = nxt
        try:
            out = os.open(_name(rel.parts[-1]), os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
        except OSError as exc:
            if exc.errno == _ELOOP:
                raise UnsafePath(exc.errno, f"{path} is a symlink; not followed") from None
            raise
    finally:
        os.close(fd)
    try:
        if not stat.S_ISREG(os.fstat(out).st_mode):
            raise UnsafePath(f"{path} is not a regular file")
    except BaseException:
        os.close(out)
        raise
    return out


def reader_for(state_dir: str | Path, uid: int, path: str | Path) -> Callable[[str | Path], int] | None:
    """`open_user_file` bound to the owner's tree when `path` lies in it; None for any other path
    (files of jobs from before the per-user tree, read with `files.open_job_file`)."""
    top = Path(state_dir, USERS_DIR, str(uid))
    if not Path(path).is_relative_to(top):
        return None
    return functools.partial(open_user_file, state_dir, uid)


def remove_job_dir(state_dir: str | Path, uid: int, job_id: str) -> None:
    """Delete `<state_dir>/users/<uid>/jobs/<job_id>` and everything in it, following no symlink
    on the way there or inside (`shutil.rmtree` relative to an fd opened with O_NOFOLLOW)."""
    try:
        fd = _open_users(state_dir)
    except FileNotFoundError:
        return
    where = Path(state_dir, USERS_DIR)
    try:
        for part in (str(uid), JOBS_DIR):
            where = where / part
            nxt = _open_dir(fd, part, str(where))
            os.close(fd)
            fd = nxt
        shutil.rmtree(_name(job_id), dir_fd=fd)
    except FileNotFoundError:
        return
    finally:
        os.close(fd)
