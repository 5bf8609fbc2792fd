"""Newline-delimited JSON framing shared by the control socket and the worker channel.

Every frame is bounded before it is parsed: by size (MAX_FRAME for replies and the worker channel,
MAX_REQUEST for requests on the control socket) and by nesting depth (MAX_DEPTH), which is checked
with a cheap scan before msgspec sees the bytes, because a deeply nested value makes msgspec raise
RecursionError rather than a decode error. A frame that breaks a bound is a FrameError with a
stable code; nothing in here lets another exception out of `Decoder.decode_frame`.
"""

from __future__ import annotations

import re
from typing import Any, Generic, TypeVar

import msgspec

MAX_FRAME = 1 << 20  # 1 MiB per frame, newline included: replies and the worker channel
MAX_REQUEST = 64 * 1024  # a request on the control socket (a job spec needs far less)
MAX_DEPTH = 32  # arrays and objects nested in one frame
PROTOCOL_VERSION = 1

T = TypeVar("T")

_encoder = msgspec.json.Encoder()
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_BRACKET = re.compile(rb"[\[\]{}]")


class FrameError(ValueError):
    """A frame that cannot be decoded into a known message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def encode(message: Any, limit: int = MAX_FRAME) -> bytes:
    """Encode one message as a single NDJSON line of at most `limit` bytes."""
    data = _encoder.encode(message)
    if len(data) + 1 > limit:
        raise FrameError("frame_too_large", f"frame of {len(data) + 1} bytes exceeds {limit}")
    return data + b"\n"


def nesting_depth(line: bytes, limit: int = MAX_DEPTH) -> int:
    """limit + 1 when arrays and objects nest deeper than `limit` in `line` (brackets inside strings
    do not count), else a number at most `limit` (0 when there are too few brackets to look).

    It does not validate the JSON: msgspec does that afterwards.
    """
    if line.count(b"[") + line.count(b"{") <= limit:
        return 0  # it cannot nest deeper than it has openers
    depth = 0
    for match in _BRACKET.finditer(_STRING.sub(b'""', line)):
        if match.group() in (b"[", b"{"):
            depth += 1
            if depth > limit:
                return limit + 1
        else:
            depth = max(0, depth - 1)
    return depth


class Decoder(Generic[T]):
    """A typed decoder that turns every failure into FrameError with a stable code."""

    def __init__(self, type: Any, limit: int = MAX_FRAME, max_depth: int = MAX_DEPTH) -> None:
        self._decoder: msgspec.json.Decoder[T] = msgspec.json.Decoder(type)
        self.limit = limit
        self.max_depth = max_depth

    def decode_frame(self, line: bytes) -> T:
        if len(line) > self.limit:
            raise FrameError("frame_too_large", f"frame of {len(line)} bytes exceeds {self.limit}")
        if nesting_depth(line, self.max_depth) > self.max_depth:
            raise FrameError("bad_message", f"invalid message: nested deeper than {self.max_depth} levels")
        try:
            return self._decoder.decode(line)
        except msgspec.ValidationError as exc:
            raise FrameError("bad_message", f"invalid message: {exc}") from None
        except msgspec.DecodeError as exc:
            raise FrameError("malformed_frame", f"malformed JSON: {exc}") from None
        except RecursionError:  # the depth scan should have caught it: belt and braces
            raise FrameError("bad_message", "invalid message: nested too deeply") from None


class LineSplitter:
    """Incremental splitter of a byte stream into bounded lines (for blocking sockets)."""

    def __init__(self, limit: int = MAX_FRAME) -> None:
        self._buf = bytearray()
        self._limit = limit

    @property
    def pending(self) -> int:
        """Bytes of an incomplete line held so far."""
        return len(self._buf)

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        lines: list[bytes] = []
        while True:
            idx = self._buf.find(b"\n")
            if idx < 0:
                break
            lines.append(bytes(self._buf[:idx]))
            del self._buf[: idx + 1]
        if len(self._buf) > self._limit:
            self._buf.clear()
            raise FrameError("frame_too_large", f"frame exceeds {self._limit} bytes")
        return lines
