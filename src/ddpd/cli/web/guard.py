"""The door of the web view: a request is served only with the token and the bound Host.

The token (query `token`, or header `X-DDPD-Token`) is compared in constant time; no cookie is
set, because cookies are not kept apart by port and another user's server on 127.0.0.1 would
receive it. The Host header must be exactly the address and port the server bound, which defeats
DNS rebinding. A POST that names an Origin (or a Sec-Fetch-Site) must come from this origin.
Every reply carries a strict Content-Security-Policy: the page loads only its own script and style.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from urllib.parse import parse_qsl

from starlette.types import ASGIApp, Message, Receive, Scope, Send

TOKEN_HEADER = "x-ddpd-token"
MAX_TOKEN = 256  # a longer token is refused unread

SECURITY_HEADERS: list[tuple[bytes, bytes]] = [
    (b"content-security-policy", b"default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                                 b"connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
    (b"cache-control", b"no-store"),
]


def _header(scope: Scope, name: bytes) -> str | None:
    headers: Iterable[tuple[bytes, bytes]] = scope.get("headers", [])
    values = [v for k, v in headers if k.lower() == name]
    if len(values) != 1:  # absent, or repeated (never trusted)
        return None
    return values[0].decode("latin-1")


def token_of(scope: Scope) -> str | None:
    """The token the request carries: its header, else its query parameter."""
    header = _header(scope, TOKEN_HEADER.encode())
    if header is not None:
        return header
    query = scope.get("query_string", b"")[:4096].decode("latin-1")
    found = [v for k, v in parse_qsl(query, keep_blank_values=True) if k == "token"]
    return found[0] if len(found) == 1 else None


class Guard:
    """ASGI middleware: Host, token and origin checks, then the security headers on every reply."""

    def __init__(self, app: ASGIApp, token: str, host: str) -> None:
        self.app = app
        self.token = token.encode()
        self.host = host  # "127.0.0.1:PORT"
        self.origin = f"http://{host}"

    def refusal(self, scope: Scope) -> tuple[int, str] | None:
        """(status, reason) when the request may not be served; None when it may."""
        if _header(scope, b"host") != self.host:
            return 421, f"the Host header must be {self.host}"
        token = token_of(scope)
        if token is None or len(token) > MAX_TOKEN or not hmac.compare_digest(token.encode(), self.token):
            return 403, "a valid token is needed: open the URL that `ddpctl web` printed"
        if scope.get("method", "GET") not in ("GET", "HEAD"):
            origin = _header(scope, b"origin")
            site = _header(scope, b"sec-fetch-site")
            if (origin is not None and origin != self.origin) or site not in (None, "same-origin"):
                return 403, "a request from another site is refused"
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":
            return  # no websockets here
        refused = self.refusal(scope)
        if refused is not None:
            await _refuse(send, *refused)
            return

        async def secured(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *SECURITY_HEADERS]}
            await send(message)

        await self.app(scope, receive, secured)


async def _refuse(send: Send, status: int, reason: str) -> None:
    body = f"{status} {reason}\n".encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"text/plain; charset=utf-8"),
                            (b"content-length", str(len(body)).encode()), *SECURITY_HEADERS]})
    await send({"type": "http.response.body", "body": body})
