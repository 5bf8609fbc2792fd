"""The daemon's end of a worker channel: non-blocking socket, NDJSON frames, no polling.

Any byte stream a worker sends becomes frames or a FrameError, never another exception.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator

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

    async def send(self, message: DaemonMessage) -> bool:
        """Send one frame; False when the worker is gone."""
        data = memoryview(encode(message))
        while data:
            try:
                sent = self.sock.send(data)
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
