"""Raw frames on the control socket, for tests that send what no client would (bytes as given,
replies read back as plain dicts, so a malformed reply is seen as it is), and the real daemon
these tests run against."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import msgspec
from anyio.streams.buffered import BufferedByteReceiveStream

from ddpd.client import AsyncClient
from ddpd.protocol import MAX_FRAME, PROTOCOL_VERSION
from ddpd.protocol.control import CancelResult, JobPage, JobView

from .conftest import DaemonProc, assert_nothing_left, start_daemon, stop_daemon


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


async def call(client: AsyncClient, request: dict[str, Any]) -> dict[str, Any]:
    """One request (after a hello); its one reply as a plain dict."""
    replies = await send_raw(client, msgspec.json.encode({"id": 1, **request}) + b"\n", expect=1)
    assert len(replies) == 1, replies
    return replies[0]


async def result(client: AsyncClient, request: dict[str, Any]) -> Any:
    reply = await call(client, request)
    assert reply["type"] == "ok", reply
    return reply.get("result")  # an Ok with no result omits it


async def page(client: AsyncClient, **fields: Any) -> JobPage:
    return msgspec.convert(await result(client, {"op": "list", **fields}), JobPage)


async def all_jobs(client: AsyncClient, *, active_only: bool = False) -> list[JobView]:
    """Every job, newest first, page after page."""
    jobs: list[JobView] = []
    before: int | None = None
    while True:
        fields: dict[str, Any] = {"all": not active_only, "limit": 500}
        if before is not None:
            fields["before"] = before
        got = await page(client, **fields)
        jobs += got.jobs
        if got.next is None:
            return jobs
        before = got.next


async def cancel(client: AsyncClient, job_id: str, force: bool = False) -> CancelResult:
    return msgspec.convert(await result(client, {"op": "cancel", "job_id": job_id, "force": force}), CancelResult)


async def ping_within(client: AsyncClient, seconds: float) -> float:
    with anyio.fail_after(seconds):
        return await client.ping()


@asynccontextmanager
async def serving_daemon(base: Path, *flags: str) -> AsyncIterator[DaemonProc]:
    """A real daemon for the block; afterwards it is stopped (exit 0) and every process of every job
    is proven gone."""
    async with anyio.create_task_group() as tg:
        d = await start_daemon(tg, base, *flags)
        try:
            yield d
        finally:
            jobs: list[JobView] = []
            if d.proc.returncode is None:
                with anyio.fail_after(30):
                    jobs = await all_jobs(d.client)
            rc = await stop_daemon(d)
            assert rc == 0, f"daemon exited with {rc}"
            assert_nothing_left(jobs)
            tg.cancel_scope.cancel()
