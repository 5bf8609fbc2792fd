"""Framing bounds: size and nesting are checked before msgspec, and every failure is a FrameError."""

from __future__ import annotations

import pytest

from ddpd.protocol import MAX_DEPTH, MAX_REQUEST, Decoder, FrameError, LineSplitter, encode
from ddpd.protocol.control import Ping, Request, RequestEnvelope
from ddpd.protocol.framing import nesting_depth


def test_nesting_depth_ignores_brackets_in_strings() -> None:
    assert nesting_depth(b"[[[]]]", 2) == 3
    assert nesting_depth(b"[[[]]]", 8) <= 8
    assert nesting_depth(b"[[]]" * 40, 32) == 0  # many openers, shallow
    assert nesting_depth(b'{"a": "[[[[[[[[[[[["}', 2) <= 2
    assert nesting_depth(b'{"a": "\\"[[[[[[[[[[["}', 2) <= 2
    assert nesting_depth(b"[" * 40, 32) == 33


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 5_000, 200_000])
def test_deep_nesting_is_a_frame_error_not_a_recursion_error(depth: int) -> None:
    """The bug: a 5 KB submit with options nested 5,000 deep made msgspec raise RecursionError,
    which escaped the connection and the root task group and killed the daemon."""
    deep = b"[" * depth + b"]" * depth
    frame = b'{"op":"submit","id":1,"spec":{"options":{"x":' + deep + b"}}}"
    for decoder in (Decoder(RequestEnvelope, limit=1 << 30), Decoder(Request, limit=1 << 30)):
        with pytest.raises(FrameError) as err:
            decoder.decode_frame(frame)
        assert err.value.code == "bad_message" and "nested" in err.value.message


def test_shallow_frames_decode() -> None:
    assert Decoder(Request).decode_frame(b'{"op":"ping","id":3}') == Ping(id=3)
    assert Decoder(RequestEnvelope).decode_frame(b'{"op":"x","id":[[1]],"a":[[[[]]]]}').op == "x"


def test_request_size_limit() -> None:
    decoder: Decoder[Request] = Decoder(Request, limit=MAX_REQUEST)
    big = b'{"op":"ping","id":1,"pad":"' + b"x" * MAX_REQUEST + b'"}'
    with pytest.raises(FrameError) as err:
        decoder.decode_frame(big)
    assert err.value.code == "frame_too_large"


def test_encode_refuses_a_frame_over_its_limit() -> None:
    with pytest.raises(FrameError):
        encode({"x": "y" * 100}, limit=50)
    assert encode(Ping(id=1)).endswith(b"\n")


def test_line_splitter_bounds_a_partial_line() -> None:
    splitter = LineSplitter(limit=16)
    assert splitter.feed(b"ab\ncd") == [b"ab"]
    assert splitter.pending == 2
    with pytest.raises(FrameError):
        splitter.feed(b"x" * 20)
