"""The daemon's end of a worker channel: non-blocking socket, NDJSON frames, no polling.

Any byte stream a worker sends becomes frames or a FrameError, never another exception.
"""

from __future__ import annotations

import array
import socket
from collections.abc import AsyncIterator, Sequence

import anyio

from ...protocol import Decoder, FrameError, LineSplitter, encode
from ...protocol.channel import DaemonMessage, WorkerMessage

_decoder: Decoder[WorkerMessage] = Decoder(WorkerMessage)


class WorkerChannel:
    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock
        self._splitter = LineSplitter()
        self.closed = False

    async def frames(self) -> AsyncIterator[WorkerMessage]:
        """Yield decoded frames until EOF; a bad frame raises FrameError."""
        while not self.closed:
            try:
                data = self.sock.recv(1 << 16)
            except BlockingIOError:
                await anyio.wait_readable(self.sock)
                continue
            except OSError:
                return
            if not data:
                return
            for line in self._splitter.feed(data):
                try:
                    message = _decoder.decode_frame(line)
                except RecursionError:  # msgspec's own error for deep nesting is not a DecodeError
                    raise FrameError("malformed_frame", "frame nested too deeply") from None
                yield message

    async def send(self, message: DaemonMessage, fds: Sequence[int] = ()) -> bool:
        """Send one frame (`fds` go with its first byte, SCM_RIGHTS); False when the worker is gone."""
        data = memoryview(encode(message))
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
        while data:
            try:
                sent = self.sock.sendmsg([data], rights) if rights else self.sock.send(data)
                rights = []
            except BlockingIOError:
                await anyio.wait_writable(self.sock)
                continue
            except OSError:
                return False
            data = data[sent:]
        return True

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.sock.close()


__all__ = ["FrameError", "WorkerChannel"]
