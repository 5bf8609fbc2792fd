"""The errors a client raises besides the daemon's own error replies (`RemoteError`).

`DaemonUnavailable`: the socket cannot be reached (or may not be trusted); `ConnectionLost`: the
daemon hung up before the reply was complete; `ProtocolError`: a reply this client cannot read.
"""

from __future__ import annotations

from pathlib import Path

import anyio

from ddpd.protocol import RemoteError


class DaemonUnavailable(RemoteError):
    """The control socket cannot be reached: missing, refused, or not permitted."""

    def __init__(self, socket_path: Path, reason: str, others: list[tuple[Path, str]] | None = None) -> None:
        where = f"at {socket_path}: {reason}"
        if others:  # the default socket: every place tried, each with its reason
            where = "; tried " + ", ".join(f"{path} ({why})" for path, why in [(socket_path, reason), *others])
        super().__init__(
            "daemon_unavailable",
            f"cannot reach ddpd{where}; is the daemon running? "
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


def unreachable(socket_path: Path, exc: OSError, others: list[tuple[Path, str]] | None = None) -> DaemonUnavailable:
    """The DaemonUnavailable for a failed connect, its reason in words (`others`: the other places
    tried, each with its reason)."""
    return DaemonUnavailable(socket_path, why_unreachable(exc), others)


def why_unreachable(exc: OSError) -> str:
    if isinstance(exc, FileNotFoundError):
        reason = "no such socket"
    elif isinstance(exc, ConnectionRefusedError):
        reason = "connection refused (no daemon is listening)"
    elif isinstance(exc, PermissionError):
        reason = "permission denied (are you in the socket's group?)"
    else:
        reason = exc.strerror or str(exc)
    return reason


def broken(exc: BaseException) -> str:
    """Why a connection broke, in words: anyio's stream errors carry no text of their own."""
    text = str(exc)
    if text:
        return text
    if isinstance(exc, anyio.ClosedResourceError):
        return "the connection was closed"
    return "the daemon closed the connection"
