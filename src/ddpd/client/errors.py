"""The errors a client raises besides the daemon's own error replies (`RemoteError`).

`DaemonUnavailable`: the socket cannot be reached (or may not be trusted); `ConnectionLost`: the
daemon hung up before the reply was complete; `ProtocolError`: a reply this client cannot read.
"""

from __future__ import annotations

from pathlib import Path

from ddpd.protocol import RemoteError


class DaemonUnavailable(RemoteError):
    """The control socket cannot be reached: missing, refused, or not permitted."""

    def __init__(self, socket_path: Path, reason: str) -> None:
        super().__init__(
            "daemon_unavailable",
            f"cannot reach ddpd at {socket_path}: {reason}; is the daemon running? "
            "Start it with `ddpd serve` (or pass --socket / set $DDPD_SOCKET).",
        )
        self.socket_path = socket_path
        self.reason = reason


class UnsafeSocket(DaemonUnavailable):
    """The default socket's directory is controlled by another user: nothing is sent there."""

    def __init__(self, socket_path: Path, reason: str) -> None:
        RemoteError.__init__(self, "unsafe_socket", reason)
        self.socket_path = socket_path
        self.reason = reason


class ConnectionLost(DaemonUnavailable):
    """The daemon closed the connection before the reply was complete."""

    def __init__(self, socket_path: Path, reason: str = "the connection closed before the reply") -> None:
        RemoteError.__init__(self, "connection_lost", f"lost the connection to ddpd at {socket_path}: {reason}")
        self.socket_path = socket_path
        self.reason = reason


class ProtocolError(RemoteError):
    """The daemon sent a frame or a result this client does not understand."""

    def __init__(self, message: str) -> None:
        super().__init__("protocol_error", message)


def unreachable(socket_path: Path, exc: OSError) -> DaemonUnavailable:
    """The DaemonUnavailable for a failed connect, its reason in words."""
    if isinstance(exc, FileNotFoundError):
        reason = "no such socket"
    elif isinstance(exc, ConnectionRefusedError):
        reason = "connection refused (no daemon is listening)"
    elif isinstance(exc, PermissionError):
        reason = "permission denied (are you in the socket's group?)"
    else:
        reason = exc.strerror or str(exc)
    return DaemonUnavailable(socket_path, reason)
