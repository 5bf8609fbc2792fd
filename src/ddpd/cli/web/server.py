"""Running the web view: bind 127.0.0.1, make the token, print the URL, serve until a signal.

The listening socket is bound here (port 0: a free one) before hypercorn is given it, so the URL
printed carries the real port and a taken port is a clear error at once; hypercorn gets it as a
`door.GuardedListener`, which admits connections by their peer's uid (a share per uid, a reserve
for the owner and root). The token is 32 random bytes (url-safe). With `--open` the browser is
given a private file that redirects to the URL (`opener`), never the URL itself. SIGINT or SIGTERM
closes the hub (ending every page's stream) and then the server, which waits `GRACE` seconds for
the last replies.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import sys
import webbrowser
from pathlib import Path

import anyio
import anyio.abc
from hypercorn.asyncio import serve
from hypercorn.config import Config, Sockets

from ddpd.client import AsyncClient

from .app import create_app
from .context import Web
from .door import Door, GuardedListener
from .hub import Hub
from .opener import remove_redirect, write_redirect
from .present import environment

HOST = "127.0.0.1"
GRACE = 1.0  # seconds the server waits for open replies when stopping
BACKLOG = 128


class PortTaken(Exception):
    """The port asked for cannot be bound on 127.0.0.1."""


def bind(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((HOST, port))
        sock.listen(BACKLOG)  # before the URL is printed: a browser that is quick waits, never refused
    except OSError as exc:
        sock.close()
        raise PortTaken(f"cannot listen on {HOST}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


class _Config(Config):
    """hypercorn's config, serving the one listener given (hypercorn owns it from here) instead of
    sockets it would make of `bind`."""

    def __init__(self, listener: socket.socket) -> None:
        self.listener = listener

    def create_sockets(self) -> Sockets:
        return Sockets(secure_sockets=[], insecure_sockets=[self.listener], quic_sockets=[])


def _config(listener: socket.socket) -> Config:
    config = _Config(listener)
    config.graceful_timeout = GRACE
    config.accesslog = None
    config.errorlog = None
    config.keep_alive_timeout = 30
    config.backlog = BACKLOG
    return config


async def run(socket_path: Path | None, port: int, open_browser: bool, refresh: float = 1.0) -> None:
    """Serve the web view of the daemon at `socket_path` until SIGINT or SIGTERM."""
    sock = bind(port)
    address = f"{HOST}:{sock.getsockname()[1]}"
    client = AsyncClient(socket_path)
    await client.ping()  # a daemon that cannot be reached is an error now, not a blank page
    hub = Hub(client)
    web = Web(client=client, hub=hub, token=secrets.token_urlsafe(32), env=environment(), viewer=os.getuid(),
              refresh=refresh)
    app = create_app(web, address)
    url = f"http://{address}/?token={web.token}"
    listener = GuardedListener(sock, Door(owner=os.getuid()))
    redirect = await anyio.to_thread.run_sync(write_redirect, url) if open_browser else None
    stop = anyio.Event()
    signals, opener = anyio.CancelScope(), anyio.CancelScope()
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(hub.run)
            await tg.start(_on_signal, hub, stop, signals)  # SIGTERM stops it cleanly once the URL is out
            sys.stdout.write(url + "\n")
            sys.stdout.flush()
            if redirect is not None:  # beside the server: a text-mode browser runs until it is left
                tg.start_soon(_open, redirect.as_uri(), opener)
            # no cancel of this task group after it: hypercorn's own asyncio task group leaves this task
            # cancelled once more than anyio counts (Python 3.11), so its children end by their own scopes
            try:
                await serve(app, _config(listener), shutdown_trigger=stop.wait)  # type: ignore[arg-type]
            finally:
                hub.close()
                signals.cancel()
                opener.cancel()
    finally:
        if redirect is not None:
            remove_redirect(redirect)


async def _open(page: str, scope: anyio.CancelScope) -> None:
    """The browser, given the redirect file's `file://` URI (the token is in the file, never in argv)."""
    with scope:
        await anyio.to_thread.run_sync(webbrowser.open, page, abandon_on_cancel=True)


async def _on_signal(hub: Hub, stop: anyio.Event, scope: anyio.CancelScope,
                     *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
    with scope, anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as received:
        task_status.started()
        async for _ in received:
            await hub.aclose()
            stop.set()
            return
