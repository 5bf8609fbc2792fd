"""Hostile connections against a real daemon: a trickled frame, idle sockets and a flood beyond
max_connections are closed or refused, while ping keeps being answered and accepted work runs."""

from __future__ import annotations

import socket
import time

import anyio
import anyio.to_thread
import pytest

from ddpd.protocol import JobState, RemoteError

from ..conftest import DaemonProc
from ..rawclient import ping_within
from .conftest import LIMITS

pytestmark = pytest.mark.anyio


def _connect(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(path)
    return sock


def _read_until_closed(sock: socket.socket) -> bytes:
    """What the daemon sent before it closed (a reset, when it closed with our bytes unread, comes
    after the data it had sent)."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def _trickle(path: str) -> tuple[float, bytes]:
    """Send a frame one byte at a time, slower than frame_timeout allows; how long until it was closed."""
    with _connect(path) as sock:
        start = time.monotonic()
        try:
            for byte in b'{"op":"ping","id":1,"pad":"' + b"x" * 100:
                sock.send(bytes([byte]))
                time.sleep(0.1)
        except (BrokenPipeError, ConnectionResetError):
            pass
        data = _read_until_closed(sock)
        return time.monotonic() - start, data


async def test_slowloris_frame_is_closed(door: DaemonProc) -> None:
    assert "frame_timeout = 1.0" in LIMITS
    async with anyio.create_task_group() as tg:
        results: list[tuple[float, bytes]] = []

        async def trickle() -> None:
            results.append(await anyio.to_thread.run_sync(_trickle, str(door.socket)))

        for _ in range(4):
            tg.start_soon(trickle)
        for _ in range(5):  # others are served meanwhile
            await ping_within(door.client, 2)
    for seconds, data in results:
        assert seconds < 10, seconds  # 12 s to send it all: closed at about frame_timeout
        assert b'"code":"timeout"' in data and b"incomplete" in data, data


async def test_idle_connection_is_closed(door: DaemonProc) -> None:
    def idle() -> tuple[float, bytes]:
        with _connect(str(door.socket)) as sock:
            start = time.monotonic()
            data = _read_until_closed(sock)
            return time.monotonic() - start, data

    seconds, data = await anyio.to_thread.run_sync(idle)
    assert 2.5 < seconds < 15, seconds  # idle_timeout = 3
    assert b'"code":"timeout"' in data and b"no request" in data, data


async def test_connection_flood_is_refused_and_ping_survives(door: DaemonProc) -> None:
    path = str(door.socket)
    job_id = await door.client.submit(door.spec(task="two-layer", steps=1))
    held = [await anyio.to_thread.run_sync(_connect, path) for _ in range(16)]  # max_connections
    try:
        extra = [await anyio.to_thread.run_sync(_connect, path) for _ in range(40)]
        for sock in extra:
            data = await anyio.to_thread.run_sync(_read_until_closed, sock)
            assert b'"code":"limit_exceeded"' in data and b"max_connections" in data, data
            sock.close()
    finally:
        for sock in held:
            sock.close()
    with anyio.fail_after(10):  # the slots come back as soon as the flood goes
        while True:
            try:
                await ping_within(door.client, 2)
                break
            except RemoteError:  # limit_exceeded until the daemon has seen the flood's sockets close
                await anyio.sleep(0.05)
    with anyio.fail_after(120):
        assert (await door.client.wait(job_id)).state == JobState.SUCCEEDED


async def test_a_follow_stream_is_not_idle(door: DaemonProc) -> None:
    """`wait` on a job that runs longer than idle_timeout still gets its answer."""
    job_id = await door.client.submit(door.spec(task="tests.tasks:slow", steps=100, options={"step_sleep": 0.05}))
    with anyio.fail_after(120):
        view = await door.client.wait(job_id)
    assert view.state == JobState.SUCCEEDED
    assert view.finished_at is not None and view.started_at is not None
