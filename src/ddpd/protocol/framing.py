"""Newline-delimited JSON framing shared by the control socket and the worker channel."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec

MAX_FRAME = 1 << 20  # 1 MiB per frame, newline included
PROTOCOL_VERSION = 1

T = TypeVar("T")

_encoder = msgspec.json.Encoder()


class FrameError(ValueError):
    """A frame that cannot be decoded into a known message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def encode(message: Any) -> bytes:
    """Encode one message as a single NDJSON line."""
    data = _encoder.encode(message)
    if len(data) + 1 > MAX_FRAME:
        raise FrameError("frame_too_large", f"frame of {len(data) + 1} bytes exceeds {MAX_FRAME}")
    return data + b"\n"


class Decoder(Generic[T]):
    """A typed decoder that turns msgspec errors into FrameError with a stable code."""

    def __init__(self, type: Any) -> None:
        self._decoder: msgspec.json.Decoder[T] = msgspec.json.Decoder(type)

    def decode_frame(self, line: bytes) -> T:
        if len(line) > MAX_FRAME:
            raise FrameError("frame_too_large", f"frame of {len(line)} bytes exceeds {MAX_FRAME}")
        try:
            return self._decoder.decode(line)
        except msgspec.ValidationError as exc:
            raise FrameError("bad_message", f"invalid message: {exc}") from None
        except msgspec.DecodeError as exc:
            raise FrameError("malformed_frame", f"malformed JSON: {exc}") from None


class LineSplitter:
    """Incremental splitter of a byte stream into bounded lines (for blocking sockets)."""

    def __init__(self, limit: int = MAX_FRAME) -> None:
        self._buf = bytearray()
        self._limit = limit

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
