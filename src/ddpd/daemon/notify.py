"""systemd integration in a few lines: sd_notify datagrams, the watchdog, socket activation.

No libsystemd: the notify protocol is one datagram of `KEY=VALUE` lines sent to $NOTIFY_SOCKET,
and socket activation is fds 3.. with $LISTEN_FDS/$LISTEN_PID. The variables are removed from our
environment once read, so no child (a worker) ever inherits them.
"""

from __future__ import annotations

import os
import socket
import stat

import anyio
import structlog

SD_LISTEN_FDS_START = 3

log = structlog.get_logger("ddpd")


class SystemdNotifier:
    """Sends READY/STATUS/WATCHDOG/STOPPING to $NOTIFY_SOCKET; a no-op without systemd."""

    def __init__(self) -> None:
        addr = os.environ.pop("NOTIFY_SOCKET", None)
        self._addr: str | None = None
        self._sock: socket.socket | None = None
        if addr and addr[0] in "/@":
            self._addr = "\0" + addr[1:] if addr.startswith("@") else addr
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        usec = os.environ.pop("WATCHDOG_USEC", None)
        wpid = os.environ.pop("WATCHDOG_PID", None)
        self.watchdog_interval: float | None = None
        if usec and usec.isdigit() and int(usec) > 0 and (not wpid or wpid == str(os.getpid())):
            self.watchdog_interval = int(usec) / 1e6 / 2
        self._last_status: str | None = None

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def send(self, *fields: str) -> None:
        """One datagram; never blocks the loop and never fails the daemon (systemd may be gone)."""
        if self._sock is None or self._addr is None:
            return
        try:
            self._sock.sendto("\n".join(fields).encode(), socket.MSG_DONTWAIT, self._addr)
        except OSError:
            pass

    def status(self, text: str) -> bool:
        """STATUS=..., sent only when it changed (then True)."""
        if text == self._last_status:
            return False
        self._last_status = text
        self.send(f"STATUS={text}")
        return True

    async def watchdog(self) -> None:
        """Pings from the event loop itself: a blocked loop stops the pings and systemd restarts us."""
        if self.watchdog_interval is None:
            return
        while True:
            self.send("WATCHDOG=1")
            await anyio.sleep(self.watchdog_interval)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def listen_fds() -> list[socket.socket]:
    """Sockets passed by systemd socket activation (only when LISTEN_PID is us)."""
    pid = os.environ.pop("LISTEN_PID", None)
    count = os.environ.pop("LISTEN_FDS", None)
    os.environ.pop("LISTEN_FDNAMES", None)
    if not pid or not count or not pid.isdigit() or not count.isdigit() or int(pid) != os.getpid():
        return []
    socks = []
    for fd in range(SD_LISTEN_FDS_START, SD_LISTEN_FDS_START + int(count)):
        try:
            mode = os.fstat(fd).st_mode
        except OSError:
            log.warning("daemon.listen_fd_invalid", fd=fd)
            continue
        if not stat.S_ISSOCK(mode):
            log.warning("daemon.listen_fd_invalid", fd=fd, reason="not a socket")
            continue
        os.set_inheritable(fd, False)
        socks.append(socket.socket(fileno=fd))
    return socks
