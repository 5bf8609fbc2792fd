"""The client's one core: `AsyncClient` over AnyIO (asyncio or trio); `Client` runs it from threads.

Each call opens one connection, says hello, sends one request and reads its reply (or its stream
of items up to the end marker). `connect()` gives a connection that carries several requests in
turn; its `request`, `call` and `stream` take any typed request or plain mapping.
"""

from __future__ import annotations

import itertools
import os
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from types import TracebackType
from typing import Any, Generic, TypeVar

import anyio
import anyio.abc
import msgspec
from anyio.streams.buffered import BufferedByteReceiveStream

from ddpd.protocol import MAX_FRAME, PROTOCOL_VERSION, JobSpec, current_umask
from ddpd.protocol.control import (
    Cancel,
    CancelResult,
    CurveReq,
    CurveResult,
    DaemonInfo,
    DaemonInfoReq,
    Events,
    EventView,
    GpuRelease,
    GpuReleaseResult,
    HelloReq,
    Item,
    JobPage,
    JobView,
    ListJobs,
    LogChunk,
    Logs,
    Ping,
    Reload,
    Remove,
    RemoveResult,
    Reply,
    Request,
    Resubmit,
    ShareReq,
    ShareResult,
    StacksReq,
    StacksResult,
    Status,
    Submit,
    SubmitResult,
    Wait,
    WhoAmI,
    WhoAmIReq,
)
from ddpd.protocol.logquery import Stream as LogStream
from ddpd.protocol.paths import SYSTEM_SOCKET, UnsafeSocketDir, client_socket_path, user_runtime_dir

from .errors import ConnectionLost, ProtocolError, UnsafeSocket, broken, unreachable, why_unreachable
from .wire import (
    RawRequest,
    cancel_result,
    check_id,
    convert,
    encode_request,
    id_of,
    job_page,
    parse_reply,
    result_of,
    stream_step,
    with_id,
)

T = TypeVar("T")

RequestFactory = Callable[[int], Request]
"""Builds a request for the id its connection gives it."""


class AsyncConnection:
    """One open control connection; requests go one after another."""

    def __init__(self, stream: anyio.abc.SocketStream, socket_path: Path) -> None:
        self.socket_path = socket_path
        self._stream = stream
        self._reader = BufferedByteReceiveStream(stream)
        self._ids = itertools.count(1)

    def next_id(self) -> int:
        return next(self._ids)

    async def send(self, req: RawRequest) -> Any:
        """Send one request; returns the id it carries."""
        req = with_id(req, self.next_id())
        try:
            await self._stream.send(encode_request(req))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            raise ConnectionLost(self.socket_path, f"sending failed: {broken(exc)}") from None
        return id_of(req)

    async def receive(self) -> Reply:
        """The next reply; ConnectionLost when the daemon closed the connection."""
        try:
            line = await self._reader.receive_until(b"\n", MAX_FRAME)
        except anyio.IncompleteRead:
            raise ConnectionLost(self.socket_path) from None
        except anyio.DelimiterNotFound:
            raise ProtocolError(f"reply frame exceeds {MAX_FRAME} bytes") from None
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            raise ConnectionLost(self.socket_path, broken(exc)) from None
        return parse_reply(line)

    async def request(self, req: RawRequest) -> Reply:
        """Send one request and return its reply as is (Ok or Error); raises only on transport trouble."""
        req_id = await self.send(req)
        return check_id(await self.receive(), req_id)

    async def call(self, req: RawRequest) -> Any:
        """Send one request and return its result; an error reply raises RemoteError."""
        return result_of(await self.request(req))

    async def stream(self, req: RawRequest) -> AsyncIterator[Reply]:
        """Send one streaming request and yield its replies, the final End or Error included."""
        req_id = await self.send(req)
        while True:
            reply = check_id(await self.receive(), req_id)
            yield reply
            if not isinstance(reply, Item):
                return

    async def hello(self) -> Any:
        return await self.call(HelloReq(id=self.next_id(), version=PROTOCOL_VERSION))

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            await self._stream.aclose()


class AsyncStream(Generic[T]):
    """The items of one follow-stream; connects on first use and closes at the end marker.

    Use it as `async with client.logs(...) as chunks: async for chunk in chunks: ...` so the
    connection is closed when the loop is left early.
    """

    def __init__(self, client: AsyncClient, make: RequestFactory, type_: type[T]) -> None:
        self._client = client
        self._make = make
        self._type = type_
        self._conn: AsyncConnection | None = None
        self._id = 0
        self._done = False

    def __aiter__(self) -> AsyncStream[T]:
        return self

    async def __anext__(self) -> T:
        if self._done:
            raise StopAsyncIteration
        try:
            if self._conn is None:
                self._conn = await self._client.open()
                self._id = self._conn.next_id()
                await self._conn.send(self._make(self._id))
            item = stream_step(check_id(await self._conn.receive(), self._id), self._type)
        except BaseException:
            await self.aclose()
            raise
        if item is None:
            await self.aclose()
            raise StopAsyncIteration
        return item

    async def aclose(self) -> None:
        self._done = True
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.aclose()

    async def __aenter__(self) -> AsyncStream[T]:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


class AsyncClient:
    """Async client of the control socket (AnyIO: runs on asyncio or trio)."""

    def __init__(self, socket_path: str | Path | None = None) -> None:
        self._unsafe: UnsafeSocketDir | None = None
        self._default = socket_path is None and not os.environ.get("DDPD_SOCKET")
        if socket_path is not None:
            self.socket_path = Path(socket_path)
        else:
            try:
                self.socket_path = client_socket_path()
            except UnsafeSocketDir as exc:  # raised when it would be used: at connect
                self.socket_path, self._unsafe = exc.path / "ddpd.sock", exc

    async def _connect(self) -> anyio.abc.SocketStream:
        """The socket's stream. The default socket that cannot be reached names every place tried:
        the user's daemon's, then the system daemon's (tried too, as root's daemon listens there)."""
        try:
            return await anyio.connect_unix(self.socket_path)
        except OSError as exc:
            if not self._default:
                raise unreachable(self.socket_path, exc) from None
            first = exc
        if self.socket_path == SYSTEM_SOCKET:  # the user's socket was not there when it was chosen
            raise unreachable(self.socket_path, first, [(user_runtime_dir() / "ddpd.sock", "no such socket")])
        try:
            stream = await anyio.connect_unix(SYSTEM_SOCKET)
        except OSError as exc:
            raise unreachable(self.socket_path, first, [(SYSTEM_SOCKET, why_unreachable(exc))]) from None
        self.socket_path = SYSTEM_SOCKET
        return stream

    async def open(self, *, hello: bool = True) -> AsyncConnection:
        """A new connection (after the hello unless `hello=False`); the caller closes it."""
        if self._unsafe is not None:
            raise UnsafeSocket(self.socket_path, str(self._unsafe))
        stream = await self._connect()
        conn = AsyncConnection(stream, self.socket_path)
        if hello:
            try:
                await conn.hello()
            except BaseException:
                await conn.aclose()
                raise
        return conn

    @asynccontextmanager
    async def connect(self, *, hello: bool = True) -> AsyncIterator[AsyncConnection]:
        conn = await self.open(hello=hello)
        try:
            yield conn
        finally:
            await conn.aclose()

    async def _call(self, make: RequestFactory) -> Any:
        async with self.connect() as conn:
            return await conn.call(make(conn.next_id()))

    # Operations

    async def hello(self) -> Any:
        async with self.connect(hello=False) as conn:
            return await conn.hello()

    async def submit(self, spec: JobSpec, *, idempotency_key: str | None = None) -> str:
        """Submit a job; its id. See `submit_result`."""
        return (await self.submit_result(spec, idempotency_key=idempotency_key)).job_id

    async def submit_result(self, spec: JobSpec, *, idempotency_key: str | None = None) -> SubmitResult:
        """Submit a job under an idempotency key (a new one unless given).

        A connection lost before the reply is retried once with the same key, so the daemon runs
        the job once whether or not the first try reached it (`existing` is then True).
        """
        key = idempotency_key if idempotency_key is not None else uuid.uuid4().hex
        if spec.umask is None:  # the submitter's, as its environment: its ranks create files as its shell would
            spec = msgspec.structs.replace(spec, umask=current_umask())

        def make(i: int) -> Request:
            return Submit(id=i, spec=spec, idempotency_key=key)

        try:
            result = await self._call(make)
        except ConnectionLost:
            result = await self._call(make)
        return convert(result, SubmitResult)

    async def resubmit(self, job_id: str, *, idempotency_key: str | None = None) -> SubmitResult:
        """Submit the stored spec of a job (its owner's) again: a new job. Retried once, as `submit_result`."""
        key = idempotency_key if idempotency_key is not None else uuid.uuid4().hex

        def make(i: int) -> Request:
            return Resubmit(id=i, job_id=job_id, idempotency_key=key)

        try:
            result = await self._call(make)
        except ConnectionLost:
            result = await self._call(make)
        return convert(result, SubmitResult)

    async def status(self, job_id: str) -> JobView:
        return convert(await self._call(lambda i: Status(id=i, job_id=job_id)), JobView)

    async def list_page(self, *, all: bool = True, limit: int = 200, before: int | None = None) -> JobPage:
        """One page of jobs, newest first; `page.next` is the `before` of the page after it (None: last)."""
        return job_page(await self._call(lambda i: ListJobs(id=i, all=all, limit=limit, before=before)))

    async def list_jobs(self, *, all: bool = True, limit: int = 200, before: int | None = None) -> list[JobView]:
        """The jobs of one page (`list_page(...).jobs`); `all=False`: only jobs not yet ended."""
        return (await self.list_page(all=all, limit=limit, before=before)).jobs

    async def iter_jobs(self, *, all: bool = True, page_size: int = 200) -> AsyncGenerator[JobView, None]:
        """Every job, newest first, a page at a time."""
        before: int | None = None
        while True:
            page = await self.list_page(all=all, limit=page_size, before=before)
            for job in page.jobs:
                yield job
            if page.next is None or not page.jobs:
                return
            before = page.next

    async def cancel(self, job_id: str, force: bool = False) -> CancelResult:
        """Cancel a job: what was done (`action`: cancelled, stopping, killing) and the job's view."""
        result = await self._call(lambda i: Cancel(id=i, job_id=job_id, force=force))
        return cancel_result(result, force)

    async def remove(self, job_id: str) -> str:
        """Forget an ended job: its record, events, logs and checkpoints. The full id of the job removed
        (`job_id` as given from a daemon that does not say)."""
        result = await self._call(lambda i: Remove(id=i, job_id=job_id))
        return job_id if result is None else convert(result, RemoveResult).job_id

    async def wait(self, job_id: str) -> JobView:
        """Block until the job is final and return its view (wrap in `anyio.fail_after` to bound it)."""
        return convert(await self._call(lambda i: Wait(id=i, job_id=job_id)), JobView)

    def logs(
        self, job_id: str, rank: int | None = None, attempt: int | None = None, follow: bool = False, *,
        ranks: list[int] | None = None, stream: LogStream = "both", tail: int | None = None, since: float | None = None,
    ) -> AsyncStream[LogChunk]:
        """Rank logs: `rank` or the rank set `ranks`, `stream` stdout|stderr|both, the last `tail` lines
        of each rank, lines received at or after `since` (seconds since the epoch)."""
        return AsyncStream(
            self, lambda i: Logs(id=i, job_id=job_id, rank=rank, attempt=attempt, follow=follow, ranks=ranks,
                                 stream=stream, tail=tail, since=since), LogChunk
        )

    def events(self, job_id: str | None = None, follow: bool = False, since: int = 0) -> AsyncStream[EventView]:
        return AsyncStream(self, lambda i: Events(id=i, job_id=job_id, follow=follow, since=since), EventView)

    async def stacks(self, job_id: str, rank: int | None = None, native: bool = False) -> StacksResult:
        """The current stack of every thread of the running job's ranks (or of `rank`), identical
        stacks grouped; the job runs on. `native`: native frames too, where the daemon has py-spy."""
        return convert(await self._call(lambda i: StacksReq(id=i, job_id=job_id, rank=rank, native=native)),
                       StacksResult)

    async def curve(self, job_id: str) -> CurveResult:
        """The job's training curve (step, loss, steps per second), downsampled by the daemon."""
        return convert(await self._call(lambda i: CurveReq(id=i, job_id=job_id)), CurveResult)

    async def ping(self) -> float:
        """Round-trip time of one ping on an open connection, in seconds."""
        async with self.connect() as conn:
            start = time.perf_counter()
            result = await conn.call(Ping(id=conn.next_id()))
            elapsed = time.perf_counter() - start
        if result != "pong":
            raise ProtocolError(f"ping answered {result!r}")
        return elapsed

    async def daemon_info(self) -> DaemonInfo:
        return convert(await self._call(lambda i: DaemonInfoReq(id=i)), DaemonInfo)

    async def reload(self) -> None:
        await self._call(lambda i: Reload(id=i))

    async def gpu_release(self, gpu: str) -> GpuReleaseResult:
        """Lift a GPU's quarantine (root and the admin group): `gpu` is its NVML index or UUID."""
        return convert(await self._call(lambda i: GpuRelease(id=i, gpu=gpu)), GpuReleaseResult)

    async def share(self) -> ShareResult:
        """Each user's recent usage and fair-share factor (see ShareView)."""
        return convert(await self._call(lambda i: ShareReq(id=i)), ShareResult)

    async def whoami(self) -> WhoAmI:
        """Who the daemon takes this client for: uid, name, groups and rights (see WhoAmI)."""
        return convert(await self._call(lambda i: WhoAmIReq(id=i)), WhoAmI)
