"""systemd integration in a few lines: sd_notify datagrams, the watchdog, socket activation."""

from __future__ import annotations

import os
import socket

import anyio

SD_LISTEN_FDS_START = 3


class Notifier:
    """Sends READY/STATUS/WATCHDOG/STOPPING to $NOTIFY_SOCKET; a no-op without systemd."""

    def __init__(self) -> None:
        addr = os.environ.pop("NOTIFY_SOCKET", None)
        self._addr: str | None = None
        self._sock: socket.socket | None = None
        if addr:
            self._addr = "\0" + addr[1:] if addr.startswith("@") else addr
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        usec = os.environ.pop("WATCHDOG_USEC", None)
        wpid = os.environ.pop("WATCHDOG_PID", None)
        self.watchdog_interval: float | None = None
        if usec and (wpid is None or int(wpid) == os.getpid()):
            self.watchdog_interval = int(usec) / 1e6 / 2

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def send(self, *fields: str) -> None:
        if self._sock is None or self._addr is None:
            return
        try:
            self._sock.sendto("\n".join(fields).encode(), self._addr)
        except OSError:
            pass

    async def watchdog(self) -> None:
        """Pings from the event loop itself: a blocked loop stops the pings and systemd restarts us."""
        if self.watchdog_interval is None:
            return
        while True:
            self.send("WATCHDOG=1")
            await anyio.sleep(self.watchdog_interval)


def listen_fds() -> list[socket.socket]:
    """Sockets passed by systemd socket activation (only when LISTEN_PID is us)."""
    pid = os.environ.pop("LISTEN_PID", None)
    count = os.environ.pop("LISTEN_FDS", None)
    os.environ.pop("LISTEN_FDNAMES", None)
    if not pid or not count or int(pid) != os.getpid():
        return []
    socks = []
    for fd in range(SD_LISTEN_FDS_START, SD_LISTEN_FDS_START + int(count)):
        os.set_inheritable(fd, False)
        socks.append(socket.socket(fileno=fd))
    return socks
