"""Reading request frames from one control connection, bounded in size and in time.

A connection waits at most `idle` seconds for the first byte of a request; once a frame has
begun it must end (newline) within `frame` seconds, so a client that trickles bytes (slowloris)
is closed; a frame longer than `limit` is refused. The buffer never holds more than `limit` plus
one read, so each connection's memory is bounded.
"""

from __future__ import annotations

import anyio
from anyio.abc import ByteReceiveStream

from ...protocol import FrameError

READ_SIZE = 64 * 1024


class ReadTimeout(Exception):
    """No complete request in time; `partial` tells a stalled frame from an idle connection."""

    def __init__(self, partial: bool, seconds: float) -> None:
        what = "a request frame stayed incomplete" if partial else "no request came"
        super().__init__(f"{what} for {seconds:g}s; closing")
        self.partial = partial


class FrameReader:
    def __init__(self, stream: ByteReceiveStream, limit: int) -> None:
        self._stream = stream
        self._limit = limit
        self._buf = bytearray()
        self._begun: float | None = None  # when the frame now in the buffer began

    async def next_frame(self, idle: float, frame: float) -> bytes | None:
        """The next request line without its newline; None when the client closed (a partial frame
        at the end is dropped). Raises FrameError (too large) or ReadTimeout."""
        waited_since = anyio.current_time()
        while True:
            idx = self._buf.find(b"\n")
            if idx >= 0:
                if idx > self._limit:
                    raise FrameError("frame_too_large", f"frame of {idx + 1} bytes exceeds {self._limit}")
                line = bytes(self._buf[:idx])
                del self._buf[: idx + 1]
                self._begun = anyio.current_time() if self._buf else None
                return line
            if len(self._buf) > self._limit:
                raise FrameError("frame_too_large", f"frame exceeds {self._limit} bytes; closing")
            now = anyio.current_time()
            if self._begun is None:
                deadline, partial, limit = waited_since + idle, False, idle
            else:
                deadline, partial, limit = self._begun + frame, True, frame
            if now >= deadline:
                raise ReadTimeout(partial, limit)
            with anyio.move_on_after(deadline - now):
                try:
                    data = await self._stream.receive(READ_SIZE)
                except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                    return None
                if data and self._begun is None:
                    self._begun = anyio.current_time()
                self._buf += data
