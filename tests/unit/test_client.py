"""The client against a small fake daemon on a real Unix socket: framing, id matching, error
replies, streams, lost connections, the submit retry, results of older daemons, the blocking
client from plain threads and Ctrl-C in ddpctl. No daemon, no worker: the fake speaks the
protocol frame by frame, as each test scripts it."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
from anyio.abc import SocketStream
from anyio.streams.buffered import BufferedByteReceiveStream

from ddpd.client import (
    AsyncClient,
    Client,
    ConnectionLost,
    DaemonUnavailable,
    JobSpec,
    ProtocolError,
    RemoteError,
)
from ddpd.protocol import MAX_FRAME

from ..conftest import REPO

pytestmark = pytest.mark.anyio

TIMEOUT = 10


def job(job_id: str, state: str = "RUNNING") -> dict[str, Any]:
    return {"id": job_id, "name": "", "state": state, "owner_uid": 0, "submitted_at": 1.0, "spec": {}}


def frame(value: Any) -> bytes:
    return msgspec.json.encode(value) + b"\n"


class Peer:
    """One connection as the fake daemon sees it: the requests it read, and a way to answer."""

    def __init__(self, stream: SocketStream) -> None:
        self.stream = stream
        self._reader = BufferedByteReceiveStream(stream)

    async def read(self) -> dict[str, Any] | None:
        try:
            request: dict[str, Any] = msgspec.json.decode(await self._reader.receive_until(b"\n", MAX_FRAME))
        except (anyio.IncompleteRead, anyio.EndOfStream, anyio.BrokenResourceError):
            return None
        return request

    async def send(self, *replies: Any) -> None:
        await self.stream.send(b"".join(frame(r) for r in replies))


Handler = Callable[[Peer, dict[str, Any]], Awaitable[bool]]
"""Answers one request (not the hello); False hangs up."""


class FakeDaemon:
    def __init__(self, path: Path, handle: Handler) -> None:
        self.path = path
        self.handle = handle
        self.requests: list[dict[str, Any]] = []
        self.closed = anyio.Event()  # set when a connection the client opened ends
        self.active = 0
        self.idle = anyio.Event()
        self.idle.set()

    async def serve(self, stream: SocketStream) -> None:
        peer = Peer(stream)
        self.active += 1
        if self.active == 1:
            self.idle = anyio.Event()
        async with stream:
            while (request := await peer.read()) is not None:
                if request.get("op") == "hello":
                    await peer.send({"type": "ok", "id": request["id"], "result": {"version": 1}})
                    continue
                self.requests.append(request)
                if not await self.handle(peer, request):
                    break
        self.closed.set()
        self.active -= 1
        if not self.active:
            self.idle.set()


@asynccontextmanager
async def fake_daemon(tmp: Path, handle: Handler) -> AsyncIterator[FakeDaemon]:
    fake = FakeDaemon(tmp / "fake.sock", handle)
    async with await anyio.create_unix_listener(fake.path) as listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, fake.serve)
        try:
            yield fake
        finally:
            # every connection ends first: cancelling a read as its socket turns readable trips asyncio
            with anyio.fail_after(TIMEOUT, shield=True):
                await fake.idle.wait()
            tg.cancel_scope.cancel()


def ok(request: dict[str, Any], result: Any) -> dict[str, Any]:
    return {"type": "ok", "id": request["id"], "result": result}


async def test_a_reply_split_across_writes_and_two_in_one_write(short_tmp: Path) -> None:
    async def handle(peer: Peer, request: dict[str, Any]) -> bool:
        data = frame(ok(request, job(request["job_id"])))
        await peer.stream.send(data[:7])  # the reader must join the pieces of one frame
        await peer.stream.send(data[7:])
        return True

    async with fake_daemon(short_tmp, handle) as fake:
        client = AsyncClient(fake.path)
        with anyio.fail_after(TIMEOUT):
            view = await client.status("j1")
            async with client.connect() as conn:  # two requests in turn on one connection
                first = await conn.call({"op": "status", "job_id": "j2"})
                second = await conn.call({"op": "status", "job_id": "j3"})
    assert view.id == "j1" and first["id"] == "j2" and second["id"] == "j3"
    assert [r["op"] for r in fake.requests] == ["status"] * 3
    assert fake.requests[1]["id"] != fake.requests[2]["id"]


async def test_a_reply_for_another_request_is_a_protocol_error(short_tmp: Path) -> None:
    async def handle(peer: Peer, request: dict[str, Any]) -> bool:
        await peer.send({"type": "ok", "id": request["id"] + 100, "result": None})
        return True

    async with fake_daemon(short_tmp, handle) as fake:
        with anyio.fail_after(TIMEOUT), pytest.raises(ProtocolError, match="reply for request"):
            await AsyncClient(fake.path).status("j1")


async def test_an_error_reply_raises_remote_error_with_its_code(short_tmp: Path) -> None:
    async def handle(peer: Peer, request: dict[str, Any]) -> bool:
        await peer.send({"type": "error", "id": request["id"], "code": "not_found", "message": "no job j9"})
        return True

    async with fake_daemon(short_tmp, handle) as fake:
        with anyio.fail_after(TIMEOUT), pytest.raises(RemoteError) as caught:
            await AsyncClient(fake.path).status("j9")
    assert (caught.value.code, caught.value.message) == ("not_found", "no job j9")


async def test_a_stream_ends_at_its_end_marker_and_an_error_in_it_raises(short_tmp: Path) -> None:
    async def handle(peer: Peer, request: dict[str, Any]) -> bool:
        i = request["id"]
        chunks = [{"type": "item", "id": i, "item": {"rank": r, "attempt": 1, "text": f"line {r}\n"}} for r in (0, 1)]
        if request.get("rank") == 5:
            await peer.send(chunks[0], {"type": "error", "id": i, "code": "not_found", "message": "no rank 5"})
        else:
            await peer.send(*chunks, {"type": "end", "id": i})
        return True

    async with fake_daemon(short_tmp, handle) as fake:
        client = AsyncClient(fake.path)
        with anyio.fail_after(TIMEOUT):
            async with client.logs("j1") as stream:
                texts = [chunk.text async for chunk in stream]
            assert texts == ["line 0\n", "line 1\n"]
            got: list[int] = []

            async def read_rank_5() -> None:
                async with client.logs("j1", rank=5) as stream:
                    async for chunk in stream:
                        got.append(chunk.rank)

            with pytest.raises(RemoteError, match="no rank 5"):
                await read_rank_5()
            assert got == [0]


async def test_a_hang_up_before_the_reply_is_connection_lost(short_tmp: Path) -> None:
    async def handle(peer: Peer, request: dict[str, Any]) -> bool:
        return False

    async with fake_daemon(short_tmp, handle) as fake:
        with anyio.fail_after(TIMEOUT), pytest.raises(ConnectionLost, match="lost the connection"):
            await AsyncClient(fake.path).wait("j1")
    with anyio.fail_after(TIMEOUT), pytest.raises(DaemonUnavailable, match="no such socket"):
        await AsyncClient(short_tmp / "nobody.sock").ping()


async def test_a_lost_submit_is_retried_once_with_the_same_key(short_tmp: Path) -> None:
    seen: dict[str, int] = {}

    async def handle(peer: Peer, request: dict[str, Any]) -> bool:
        key = request["idempotency_key"]
        seen[key] = seen.get(key, 0) + 1
        name = request["spec"].get("name")
        if name == "always lost" or (name == "lost" and seen[key] == 1):
            return False  # read, maybe acted on, never answered
        await peer.send(ok(request, {"job_id": "j7", "existing": seen[key] > 1}))
        return True

    async with fake_daemon(short_tmp, handle) as fake:
        client = AsyncClient(fake.path)
        with anyio.fail_after(TIMEOUT):
            result = await client.submit_result(JobSpec(name="lost"))
            assert (result.job_id, result.existing) == ("j7", True)
            first, second = fake.requests
            assert first["idempotency_key"] == second["idempotency_key"] and len(first["idempotency_key"]) == 32

            assert await client.submit(JobSpec(name="ok"), idempotency_key="mine") == "j7"
            assert fake.requests[-1]["idempotency_key"] == "mine"
            await client.submit(JobSpec(name="ok"))
            assert fake.requests[-1]["idempotency_key"] not in (first["idempotency_key"], "mine")

            fake.requests.clear()
            with pytest.raises(ConnectionLost):
                await client.submit(JobSpec(name="always lost"))
            assert len(fake.requests) == 2  # one retry, no more


async def test_pages_cancel_reports_and_the_results_of_an_older_daemon(short_tmp: Path) -> None:
    async def handle(peer: Peer, request: dict[str, Any]) -> bool:
        match request["op"]:
            case "list" if request["limit"] == 1:  # paged: newest first, j3 j2 j1
                before = request.get("before") or 4
                page = {"jobs": [job(f"j{before - 1}")], "next": before - 1 if before > 2 else None}
                await peer.send(ok(request, page))
            case "list":  # a daemon from before paging answers a bare list
                await peer.send(ok(request, [job("j2"), job("j1")]))
            case "cancel" if request["job_id"] == "old":
                state = "CANCELLED" if not request["force"] else "RUNNING"
                await peer.send(ok(request, job("old", state)))
            case "cancel":
                await peer.send(ok(request, {"action": "stopping", "job": job(request["job_id"])}))
            case "rm":
                await peer.send(ok(request, None))
        return True

    async with fake_daemon(short_tmp, handle) as fake:
        client = AsyncClient(fake.path)
        with anyio.fail_after(TIMEOUT):
            page = await client.list_page(all=False)
            assert [j.id for j in page.jobs] == ["j2", "j1"] and page.next is None
            assert fake.requests[-1]["all"] is False
            assert [j.id async for j in client.iter_jobs(page_size=1)] == ["j3", "j2", "j1"]
            assert [r.get("before") for r in fake.requests[-3:]] == [None, 3, 2]
            assert [j.id for j in await client.list_jobs(limit=1, before=3)] == ["j2"]
            with Client(fake.path).iter_jobs(page_size=1) as jobs:  # the blocking one, from a thread
                assert [j.id for j in await anyio.to_thread.run_sync(list, jobs)] == ["j3", "j2", "j1"]

            assert (await client.cancel("new")).action == "stopping"
            assert (await client.cancel("old")).action == "cancelled"
            assert (await client.cancel("old", force=True)).action == "killing"
            await client.remove("j1")
            assert fake.requests[-1] == {"op": "rm", "id": fake.requests[-1]["id"], "job_id": "j1"}


async def test_the_blocking_client_from_plain_threads(short_tmp: Path) -> None:
    async def handle(peer: Peer, request: dict[str, Any]) -> bool:
        if request["op"] == "events":
            items = [{"type": "item", "id": request["id"], "item": {"seq": s, "ts": 1.0, "kind": "k"}} for s in (1, 2)]
            await peer.send(*items, {"type": "end", "id": request["id"]})
        else:
            await peer.send(ok(request, job(request["job_id"])))
        return True

    def use(client: Client, results: list[Any]) -> None:
        results.append(client.status("j1").id)
        with client.events("j1") as events:
            results.append([e.seq for e in events])
        with client.connect() as conn:
            results.append([type(r).__name__ for r in conn.stream({"op": "events", "job_id": "j1"})])

    async with fake_daemon(short_tmp, handle) as fake:
        client = Client(fake.path)
        results: list[list[Any]] = [[], [], []]
        threads = [threading.Thread(target=use, args=(client, r)) for r in results]
        with anyio.fail_after(TIMEOUT):
            for t in threads:
                t.start()
            for t in threads:
                await anyio.to_thread.run_sync(t.join)
    assert results == [["j1", [1, 2], ["Item", "Item", "End"]]] * 3
    assert not [t for t in threading.enumerate() if t.name.startswith("ddpd-client")]  # portals stopped


# ddpctl as a terminal starts it: Ctrl-C raises KeyboardInterrupt. A test run started in the background
# of a non-interactive shell has SIGINT ignored, and its children inherit that (Python then leaves it so)
INTERRUPTIBLE = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
                 "sys.argv[0] = 'ddpctl'; runpy.run_module('ddpd.cli', run_name='__main__', alter_sys=True)")


@pytest.mark.parametrize(("command", "shown"), [(["logs", "-f", "j1"], b"ready"),
                                               (["watch", "j1", "-o", "json"], b"RUNNING")])
async def test_ctrl_c_stops_a_follow_stream_in_ddpctl_at_once(short_tmp: Path, command: list[str],
                                                               shown: bytes) -> None:
    following = anyio.Event()

    async def handle(peer: Peer, request: dict[str, Any]) -> bool:
        if request["op"] == "status":
            await peer.send(ok(request, job("j1")))
            return True
        item = {"rank": 0, "attempt": 1, "text": "ready\n"} if request["op"] == "logs" else {"seq": 1, "ts": 1.0,
                                                                                            "kind": "k"}
        await peer.send({"type": "item", "id": request["id"], "item": item})
        following.set()
        return True  # and never a line more: the stream follows a job that keeps running

    async with fake_daemon(short_tmp, handle) as fake:
        with anyio.fail_after(3 * TIMEOUT):  # a ddpctl's start (its imports) on a loaded 2-core machine
            async with await anyio.open_process(
                [sys.executable, "-c", INTERRUPTIBLE, "--socket", str(fake.path), *command],
                stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=str(REPO),
            ) as proc:
                assert proc.stdout is not None
                await following.wait()
                out = b""
                while shown not in out:  # printed: now blocked on the next item
                    out += await proc.stdout.receive()
                proc.send_signal(signal.SIGINT)
                assert await proc.wait() == (130 if command[0] == "logs" else 0)  # watch: Ctrl-C is its way out
            await fake.closed.wait()  # and its connections are closed
