"""`ddpctl web` for tests: started as a user starts it (a subprocess), its URL read from its stdout
(the handshake), stopped with SIGTERM and proven gone. Shared by the HTTP and the browser tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import anyio
from anyio.abc import Process

from ..conftest import REPO, assert_gone
from ..scripts.userpython import USER_PYTHON, user_env

DDPCTL = str(Path(sys.executable).parent / "ddpctl")
START_TIMEOUT = 60


@dataclass
class WebServer:
    url: str  # as printed: http://127.0.0.1:PORT/?token=...
    proc: Process

    @property
    def origin(self) -> str:
        parts = urlsplit(self.url)
        return f"{parts.scheme}://{parts.netloc}"

    @property
    def host(self) -> str:
        return urlsplit(self.url).netloc

    @property
    def token(self) -> str:
        return self.url.rsplit("token=", 1)[1]

    def at(self, path: str, **query: str) -> str:
        """`path` on this server with the token (and `query`)."""
        params = "&".join(f"{k}={v}" for k, v in {**query, "token": self.token}.items())
        return f"{self.origin}{path}?{params}"


async def _read_url(proc: Process) -> str:
    assert proc.stdout is not None
    text = b""
    with anyio.fail_after(START_TIMEOUT):
        async for data in proc.stdout:
            text += data
            if b"\n" in text:
                return text.split(b"\n", 1)[0].decode()
    assert proc.stderr is not None
    raise AssertionError(f"ddpctl web printed no URL: {text!r} {(await proc.stderr.receive()).decode()!r}")


async def _rest(proc: Process) -> str:
    """What the ended server wrote on stderr (for a failure's message)."""
    assert proc.stderr is not None
    out = b""
    with anyio.move_on_after(5):
        async for data in proc.stderr:
            out += data
    return out.decode(errors="replace")[-4000:]


@asynccontextmanager
async def web_server(socket: Path, *args: str, uid: int | None = None, env: dict[str, str] | None = None,
                     prefix: tuple[str, ...] = ()) -> AsyncIterator[WebServer]:
    """`ddpctl web` on the daemon at `socket`, for the block; then SIGTERM, exit 0 and gone.

    `uid`: run it as that user (and group of the same number), with the interpreter and path other
    users can use (tests.scripts.userpython; the caller opens the checkout to them). `prefix`: a
    command it runs under (`sh -c 'ulimit -n N; exec "$@"' sh`), which execs it (the same pid)."""
    argv, environ = [DDPCTL], {**os.environ, "BROWSER": "true", **(env or {})}
    if uid is not None:
        argv = [USER_PYTHON, "-c", "from ddpd.cli import main; main()"]
        environ = user_env(**{"HOME": "/tmp", "BROWSER": "true", **(env or {})})
    proc = await anyio.open_process([*prefix, *argv, "--socket", str(socket), "web", *args], stdin=subprocess.DEVNULL,
                                    cwd="/" if uid is not None else str(REPO), env=environ, user=uid, group=uid,
                                    extra_groups=None if uid is None else [])
    try:
        url = await _read_url(proc)
        assert url.startswith("http://127.0.0.1:") and "token=" in url, url
        yield WebServer(url, proc)
    finally:
        with anyio.CancelScope(shield=True):
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
            with anyio.move_on_after(30):
                await proc.wait()
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            errors = await _rest(proc)
            await proc.aclose()
    assert proc.returncode == 0, f"ddpctl web exited with {proc.returncode}: {errors}"
    assert_gone(proc.pid)
