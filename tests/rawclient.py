"""Raw frames on the control socket, for tests that send what no client would: bytes as given,
replies read back as plain dicts (no typed decoding, so a malformed reply is seen as it is)."""

from __future__ import annotations

from typing import Any

import anyio
import msgspec
from anyio.streams.buffered import BufferedByteReceiveStream

from ddpd.client import AsyncClient
from ddpd.protocol import MAX_FRAME, PROTOCOL_VERSION


async def send_raw(client: AsyncClient, data: bytes, *, hello: bool = True,
                   expect: int | None = None) -> list[dict[str, Any]]:
    """Send `data` on a new connection (after a hello unless `hello=False`); the replies as dicts.

    With `expect`, stop after that many replies; without it, half-close the connection and read
    until the daemon closes it. A daemon that hangs up on a bad frame ends the reading, not the test.
    """
    async with await anyio.connect_unix(client.socket_path) as stream:
        reader = BufferedByteReceiveStream(stream)
        if hello:
            await stream.send(msgspec.json.encode({"op": "hello", "id": 0, "version": PROTOCOL_VERSION}) + b"\n")
            await reader.receive_until(b"\n", MAX_FRAME)
        try:
            await stream.send(data)
            if expect is None:
                await stream.send_eof()
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass  # the daemon may hang up on a bad frame; read what it said before that
        replies: list[dict[str, Any]] = []
        while expect is None or len(replies) < expect:
            try:
                line = await reader.receive_until(b"\n", MAX_FRAME)
            except (anyio.IncompleteRead, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                break
            replies.append(msgspec.json.decode(line))
        return replies
