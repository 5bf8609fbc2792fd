"""Where the control socket and the state directory live by default (shared by daemon and client).

A per-user daemon's directories are the user's as platformdirs finds them (XDG). Its socket may
live in a directory under a world-writable place (`/tmp/ddpd-$UID` when the user has no runtime
directory): another local user can create that directory first and receive the submissions sent
to it. `check_socket_dir` refuses such a directory (the client checks before it
connects), and `make_runtime_dir` creates it 0700 (the daemon, before it binds).
"""

from __future__ import annotations

import os
import pwd
import stat
import tempfile
import warnings
from pathlib import Path

import platformdirs

SYSTEM_SOCKET = Path("/run/ddpd/ddpd.sock")


class UnsafeSocketDir(Exception):
    """A socket directory that someone other than the user or root controls."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"refusing the socket directory {path}: {reason}")
        self.path = path
        self.reason = reason


def _user_name(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def check_socket_dir(path: Path, uid: int | None = None) -> None:
    """Raise UnsafeSocketDir unless `path` is a directory (not a symlink) owned by `uid` (default: the
    caller's) or root, and not writable by group or others unless it has the sticky bit.

    A directory that does not exist passes: there is nothing to connect to, and nobody to trust.
    """
    uid = os.getuid() if uid is None else uid
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a directory"
        raise UnsafeSocketDir(path, f"{kind}, owned by {_user_name(st.st_uid)}")
    if st.st_uid not in (uid, 0):
        raise UnsafeSocketDir(
            path, f"owned by {_user_name(st.st_uid)}, not by you ({_user_name(uid)}) or root; "
            "another user may be listening there"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        raise UnsafeSocketDir(
            path, f"mode {stat.S_IMODE(st.st_mode):04o} (owned by {_user_name(st.st_uid)}) lets other "
            "users replace the socket: writable by group or others without the sticky bit"
        )


def make_runtime_dir(path: Path) -> None:
    """Create a per-user runtime directory 0700 (parents as needed) and check it as a client would."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    check_socket_dir(path)


def user_runtime_dir() -> Path:
    """`ddpd` in the user's runtime directory as platformdirs finds it ($XDG_RUNTIME_DIR when it is a
    private directory of the user, as the XDG spec asks, else /run/user/$UID); /tmp/ddpd-$UID where
    the user has none (a container, a cron job)."""
    try:
        with warnings.catch_warnings():  # platformdirs warns of each fallback: the one here is ours
            warnings.simplefilter("ignore")
            base = Path(platformdirs.user_runtime_dir())
    except OSError:  # its own temporary fallback planted by someone else
        base = None
    if base is not None and base.is_dir() and base.parent != Path(tempfile.gettempdir()):
        return base / "ddpd"
    return Path(f"/tmp/ddpd-{os.getuid()}")


def daemon_socket_path() -> Path:
    """The socket a daemon binds when no flag or config says otherwise."""
    runtime = os.environ.get("RUNTIME_DIRECTORY")
    if runtime:
        return Path(runtime.split(":")[0]) / "ddpd.sock"
    if os.getuid() == 0:
        return SYSTEM_SOCKET
    return user_runtime_dir() / "ddpd.sock"


def daemon_state_dir() -> Path:
    state = os.environ.get("STATE_DIRECTORY")
    if state:
        return Path(state.split(":")[0])
    if os.getuid() == 0:
        return Path("/var/lib/ddpd")
    return platformdirs.user_state_path("ddpd")  # $XDG_STATE_HOME/ddpd, else ~/.local/state/ddpd


def client_socket_path() -> Path:
    """The socket a client talks to: $DDPD_SOCKET, the user's daemon, else the system daemon.

    The user's socket directory is checked (`check_socket_dir`) when it is the one chosen; raises
    UnsafeSocketDir. An explicit path ($DDPD_SOCKET, a flag) is the caller's choice and is not.
    """
    env = os.environ.get("DDPD_SOCKET")
    if env:
        return Path(env)
    user = user_runtime_dir() / "ddpd.sock"
    if user.exists() or not SYSTEM_SOCKET.exists():
        check_socket_dir(user.parent)
        return user
    return SYSTEM_SOCKET
