"""The daemon's own files are its user's alone, whatever shell started it.

Bug (issue 34, finding 4): a daemon started outside its unit (`sudo ddpd serve`, the README's
`ddpd serve &`, a container's entry point) kept that shell's umask, usually 022: `ddpd.db`, its
`-wal` and `-shm` were 0644 in a 0711 directory, and any local user read every job's exported
environment by the documented path. So:

- the daemon's umask is 077 from its start (`private_umask`), as the unit's `UMask=0077`;
- the database file is created 0600 before SQLite opens it (SQLite gives the WAL and the
  shared-memory file the database's mode), never left to the umask;
- an existing file of the daemon at the top of the state directory (the database, its WAL and
  -shm, pool.log) with any group or other bit is narrowed to its owner's bits before the database
  is opened (`narrow`); the caller logs which, with their old modes (`state.files_narrowed`);
- directories the daemon creates that others must traverse (the state directory's missing
  parents, the control socket's) get an explicit 0755, as they did under a 022 umask.

All functions block (file system): call them via anyio.to_thread.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from ..layout import daemon_files, database

DAEMON_UMASK = 0o077
PRIVATE_FILE = 0o600
PUBLIC_DIR = 0o755  # a parent others traverse to reach their own tree or the socket
_OPEN = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


@dataclass(frozen=True)
class Narrowed:
    """A file of the daemon whose group or other bits were removed at start."""

    path: str
    was: str  # the old mode, octal ("0644")
    now: str


def private_umask() -> int:
    """Set the daemon's umask to 077; the umask it had (inherited from whatever started it)."""
    return os.umask(DAEMON_UMASK)


def make_dirs(path: Path, mode: int = PUBLIC_DIR) -> None:
    """`path` and its missing parents, each created `mode` (explicitly: the daemon's umask is 077)."""
    missing: list[Path] = []
    for p in [path, *path.parents]:
        if p.is_dir():
            break
        missing.append(p)
    for p in reversed(missing):
        try:
            p.mkdir(mode)
        except FileExistsError:
            if not p.is_dir():
                raise
            continue
        os.chmod(p, mode)  # mkdir's mode passes through the umask


def narrow(state_dir: Path) -> list[Narrowed]:
    """Remove group and other bits from the daemon's files at the top of `state_dir` (those of
    `layout.daemon_files`, regular files of the daemon's user, never followed through a link)."""
    done: list[Narrowed] = []
    for path in daemon_files(state_dir):
        try:
            fd = os.open(path, _OPEN)
        except OSError:  # absent, or a link (O_NOFOLLOW): nothing of ours to narrow
            continue
        try:
            st = os.fstat(fd)
            mode = stat.S_IMODE(st.st_mode)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and mode & 0o077:
                os.fchmod(fd, mode & 0o700)
                done.append(Narrowed(str(path), f"{mode:04o}", f"{mode & 0o700:04o}"))
        finally:
            os.close(fd)
    return done


def create_database(state_dir: Path) -> None:
    """The database file, created 0600 where it is missing (SQLite then opens what is there)."""
    try:
        fd = os.open(database(state_dir), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, PRIVATE_FILE)
    except FileExistsError:
        return
    os.close(fd)
