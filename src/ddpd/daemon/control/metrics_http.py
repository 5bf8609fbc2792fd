"""The metrics endpoint's HTTP front: GET /metrics, one request per connection, a bearer token.

The config requires the token unless `metrics_public = true` (then `token` is None and anyone who
can connect reads every job's loss, steps and memory).

Minimal HTTP/1.0 on an AnyIO listener bound before the daemon reports ready (a taken port is an error
at start). A request head is bounded (`MAX_REQUEST` bytes) and the whole exchange by `EXCHANGE_TIMEOUT`;
the token is compared in constant time. The body comes from `render` (Prometheus' text format).
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

import anyio
import structlog
from anyio.abc import SocketAttribute, SocketListener, SocketStream
from anyio.streams.buffered import BufferedByteReceiveStream
from anyio.streams.stapled import MultiListener
from prometheus_client import CONTENT_TYPE_LATEST

from .door import accept_forever

log = structlog.get_logger("ddpd")

MAX_REQUEST = 8192
EXCHANGE_TIMEOUT = 10.0


class MetricsServer:
    def __init__(self, render: Callable[[], Awaitable[bytes]], token: str | None) -> None:
        self.render = render
        self.token = token

    @staticmethod
    async def listen(host: str, port: int) -> MultiListener[SocketStream]:
        """Bound before the daemon reports ready, so a taken port is an error at start."""
        listener = await anyio.create_tcp_listener(local_host=host, local_port=port)
        ports = sorted({sub.extra(SocketAttribute.local_port) for sub in listener.listeners})
        log.info("metrics.listening", host=host, port=ports[0] if ports else None)
        return listener

    async def serve(self, listener: MultiListener[SocketStream]) -> None:
        """Accept on every address until cancelled; no accept() error ends it (`door.accept_forever`)."""
        async with listener, anyio.create_task_group() as tg:
            for sub in listener.listeners:
                assert isinstance(sub, SocketListener)
                tg.start_soon(accept_forever, sub, self._handle, "metrics")

    async def _handle(self, stream: SocketStream) -> None:
        async with stream:
            try:
                with anyio.fail_after(EXCHANGE_TIMEOUT):
                    head = await BufferedByteReceiveStream(stream).receive_until(b"\r\n\r\n", MAX_REQUEST)
                    status, payload = await self._answer(head)
                    ctype = CONTENT_TYPE_LATEST if status.startswith("200") else "text/plain; charset=utf-8"
                    await stream.send(
                        f"HTTP/1.0 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(payload)}\r\n"
                        f"Connection: close\r\n\r\n".encode() + payload)
            except (TimeoutError, anyio.DelimiterNotFound, anyio.IncompleteRead, anyio.EndOfStream,
                    anyio.BrokenResourceError, OSError):
                return

    async def _answer(self, head: bytes) -> tuple[str, bytes]:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split()
        if len(parts) != 3 or parts[0] != "GET":
            return "405 Method Not Allowed", b"only GET /metrics\n"
        if self.token is not None:
            headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
            given = headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
                return "401 Unauthorized", b"a bearer token is required\n"
        if parts[1].split("?")[0] != "/metrics":
            return "404 Not Found", b"try /metrics\n"
        return "200 OK", await self.render()
