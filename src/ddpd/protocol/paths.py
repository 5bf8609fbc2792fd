"""Where the control socket and the state directory live by default (shared by daemon and client)."""

from __future__ import annotations

import os
from pathlib import Path

SYSTEM_SOCKET = Path("/run/ddpd/ddpd.sock")


def user_runtime_dir() -> Path:
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg):
        return Path(xdg) / "ddpd"
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
    xdg = os.environ.get("XDG_STATE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".local" / "state"
    return base / "ddpd"


def client_socket_path() -> Path:
    """The socket a client talks to: $DDPD_SOCKET, the user's daemon, else the system daemon."""
    env = os.environ.get("DDPD_SOCKET")
    if env:
        return Path(env)
    user = user_runtime_dir() / "ddpd.sock"
    if user.exists() or not SYSTEM_SOCKET.exists():
        return user
    return SYSTEM_SOCKET
