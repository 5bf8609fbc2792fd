"""Python API of ddpd's control socket: `Client` (blocking sockets) and `AsyncClient` (AnyIO).

Each call opens one connection, says hello, sends one request and reads its reply (or its
stream of items up to the end marker). `connect()` gives a connection that carries several
requests in turn, and the raw `request`, `stream` and `send_raw` let tests send any frame.

Error replies raise `RemoteError(code, message)`; a socket that cannot be reached raises
`DaemonUnavailable`, and a daemon that hangs up mid-reply `ConnectionLost`.
"""

from __future__ import annotations

import itertools
import re
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any, Generic, TypeVar

import anyio
import anyio.abc
import msgspec
from anyio.streams.buffered import BufferedByteReceiveStream

from ddpd.protocol import (
    BUILTIN_TASKS,
    MAX_FRAME,
    PROTOCOL_VERSION,
    Decoder,
    ErrorCode,
    FrameError,
    JobSpec,
    JobState,
    LineSplitter,
    RankState,
    RemoteError,
    SpecError,
    Timeouts,
    check_spec,
    encode,
)
from ddpd.protocol.control import (
    Cancel,
    DaemonInfo,
    DaemonInfoReq,
    End,
    Error,
    Events,
    EventView,
    HelloReq,
    Item,
    JobView,
    ListJobs,
    LogChunk,
    Logs,
    Ok,
    Ping,
    RankView,
    Reload,
    Reply,
    Request,
    RootCause,
    Status,
    Submit,
    SubmitResult,
    Wait,
)
from ddpd.protocol.paths import client_socket_path

__all__ = [
    "BUILTIN_TASKS",
    "AsyncClient",
    "AsyncConnection",
    "AsyncStream",
    "Client",
    "Connection",
    "ConnectionLost",
    "DaemonInfo",
    "DaemonUnavailable",
    "ErrorCode",
    "EventView",
    "JobSpec",
    "JobState",
    "JobView",
    "LogChunk",
    "ProtocolError",
    "RankState",
    "RankView",
    "RemoteError",
    "Reply",
    "Request",
    "RootCause",
    "SpecError",
    "Stream",
    "Timeouts",
    "build_spec",
    "check_spec",
]

T = TypeVar("T")

RawRequest = Request | Mapping[str, Any]
"""A typed request (its `id` is sent as given) or a plain mapping (given an id if it has none)."""

_READ_SIZE = 65536


# Errors


class DaemonUnavailable(RemoteError):
    """The control socket cannot be reached: missing, refused, or not permitted."""

    def __init__(self, socket_path: Path, reason: str) -> None:
        super().__init__(
            "daemon_unavailable",
            f"cannot reach ddpd at {socket_path}: {reason}; is the daemon running? "
            "Start it with `ddpd serve` (or pass --socket / set $DDPD_SOCKET).",
        )
        self.socket_path = socket_path
        self.reason = reason


class ConnectionLost(DaemonUnavailable):
    """The daemon closed the connection before the reply was complete."""

    def __init__(self, socket_path: Path, reason: str = "the connection closed before the reply") -> None:
        RemoteError.__init__(self, "connection_lost", f"lost the connection to ddpd at {socket_path}: {reason}")
        self.socket_path = socket_path
        self.reason = reason


class ProtocolError(RemoteError):
    """The daemon sent a frame or a result this client does not understand."""

    def __init__(self, message: str) -> None:
        super().__init__("protocol_error", message)


def _unreachable(socket_path: Path, exc: OSError) -> DaemonUnavailable:
    if isinstance(exc, FileNotFoundError):
        reason = "no such socket"
    elif isinstance(exc, ConnectionRefusedError):
        reason = "connection refused (no daemon is listening)"
    elif isinstance(exc, PermissionError):
        reason = "permission denied (are you in the socket's group?)"
    else:
        reason = exc.strerror or str(exc)
    return DaemonUnavailable(socket_path, reason)


# Frames and results, shared by both clients

_reply_decoder: Decoder[Reply] = Decoder(Reply)


def _with_id(req: RawRequest, req_id: int) -> RawRequest:
    if isinstance(req, Mapping) and "id" not in req:
        return {**req, "id": req_id}
    return req


def _id_of(req: RawRequest) -> Any:
    return req.get("id") if isinstance(req, Mapping) else req.id


def _encode(req: RawRequest) -> bytes:
    try:
        return encode(req)
    except FrameError as exc:
        raise RemoteError(exc.code, exc.message) from None


def _parse_reply(line: bytes) -> Reply:
    try:
        return _reply_decoder.decode_frame(line)
    except FrameError as exc:
        raise ProtocolError(f"bad reply from the daemon: {exc.message}") from None


def _parse_raw(line: bytes) -> dict[str, Any]:
    try:
        value = msgspec.json.decode(line)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"bad reply from the daemon: {exc}") from None
    if not isinstance(value, dict):
        raise ProtocolError(f"bad reply from the daemon: not an object: {line[:200]!r}")
    return value


def _check_id(reply: Reply, req_id: Any) -> Reply:
    if reply.id is not None and reply.id != req_id:
        raise ProtocolError(f"reply for request {reply.id} while waiting for request {req_id}")
    return reply


def _result(reply: Reply) -> Any:
    if isinstance(reply, Ok):
        return reply.result
    if isinstance(reply, Error):
        raise RemoteError(reply.code, reply.message)
    raise ProtocolError(f"unexpected {type(reply).__name__.lower()} reply to a request")


def _convert(value: Any, type_: type[T]) -> T:
    try:
        return msgspec.convert(value, type_)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"bad result from the daemon: {exc}") from None


def _stream_step(reply: Reply, type_: type[T]) -> T | None:
    """The item a stream reply carries; None at the end marker; raises on an error reply."""
    if isinstance(reply, Item):
        return _convert(reply.item, type_)
    if isinstance(reply, End):
        return None
    if isinstance(reply, Error):
        raise RemoteError(reply.code, reply.message)
    raise ProtocolError("unexpected ok reply inside a stream")


def build_spec(fields: Mapping[str, Any]) -> JobSpec:
    """A JobSpec from plain values, checked as the daemon checks it; SpecError names the field.

    The spec returned is the one given (defaults left for the daemon to fill in).
    """
    try:
        spec = msgspec.convert(fields, JobSpec)
    except msgspec.ValidationError as exc:
        message, sep, path = str(exc).rpartition(" - at `")
        if not sep:
            unknown = re.search(r"unknown field `([^`]*)`", str(exc))
            raise SpecError(unknown.group(1) if unknown else "spec", str(exc)) from None
        field = path.rstrip("`").removeprefix("$").lstrip(".") or "spec"
        raise SpecError(field, message) from None
    check_spec(spec)
    return spec


# Requests built by the high-level methods (the id is filled in per connection)

RequestFactory = Callable[[int], Request]


def _hello(i: int) -> Request:
    return HelloReq(id=i, version=PROTOCOL_VERSION)


def _logs_request(job_id: str, rank: int | None, attempt: int | None, follow: bool) -> RequestFactory:
    return lambda i: Logs(id=i, job_id=job_id, rank=rank, attempt=attempt, follow=follow)


def _events_request(job_id: str | None, follow: bool, since: int) -> RequestFactory:
    return lambda i: Events(id=i, job_id=job_id, follow=follow, since=since)


# Async


class AsyncConnection:
    """One open control connection; requests go one after another."""

    def __init__(self, stream: anyio.abc.SocketStream, socket_path: Path) -> None:
        self.socket_path = socket_path
        self._stream = stream
        self._reader = BufferedByteReceiveStream(stream)
        self._ids = itertools.count(1)

    def next_id(self) -> int:
        return next(self._ids)

    async def send_raw(self, data: bytes) -> None:
        try:
            await self._stream.send(data)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            raise ConnectionLost(self.socket_path, f"sending failed: {exc}") from None

    async def send(self, req: RawRequest) -> Any:
        """Send one request; returns the id it carries."""
        req = _with_id(req, self.next_id())
        await self.send_raw(_encode(req))
        return _id_of(req)

    async def receive_line(self) -> bytes | None:
        """The next frame, without its newline; None when the daemon closed the connection."""
        try:
            return await self._reader.receive_until(b"\n", MAX_FRAME)
        except anyio.IncompleteRead:
            return None
        except anyio.DelimiterNotFound:
            raise ProtocolError(f"reply frame exceeds {MAX_FRAME} bytes") from None
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            raise ConnectionLost(self.socket_path, str(exc)) from None

    async def receive(self) -> Reply:
        line = await self.receive_line()
        if line is None:
            raise ConnectionLost(self.socket_path)
        return _parse_reply(line)

    async def request(self, req: RawRequest) -> Reply:
        """Send one request and return its reply as is (Ok or Error); raises only on transport trouble."""
        req_id = await self.send(req)
        return _check_id(await self.receive(), req_id)

    async def call(self, req: RawRequest) -> Any:
        """Send one request and return its result; an error reply raises RemoteError."""
        return _result(await self.request(req))

    async def stream(self, req: RawRequest) -> AsyncIterator[Reply]:
        """Send one streaming request and yield its replies, the final End or Error included."""
        req_id = await self.send(req)
        while True:
            reply = _check_id(await self.receive(), req_id)
            yield reply
            if not isinstance(reply, Item):
                return

    async def send_raw_frames(self, data: bytes, *, expect: int | None = None) -> list[dict[str, Any]]:
        """Send bytes as they are and collect the replies as plain dicts.

        With `expect`, stop after that many replies; without it, half-close the connection and
        read until the daemon closes it.
        """
        try:
            await self._stream.send(data)
            if expect is None:
                await self._stream.send_eof()
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass  # the daemon may hang up on a bad frame; read what it said before that
        replies: list[dict[str, Any]] = []
        while expect is None or len(replies) < expect:
            try:
                line = await self.receive_line()
            except ConnectionLost:
                line = None
            if line is None:
                break
            replies.append(_parse_raw(line))
        return replies

    async def hello(self) -> Any:
        return await self.call(_hello(self.next_id()))

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
            item = _stream_step(_check_id(await self._conn.receive(), self._id), self._type)
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
        self.socket_path = Path(socket_path) if socket_path is not None else client_socket_path()

    async def open(self, *, hello: bool = True) -> AsyncConnection:
        """A new connection (after the hello unless `hello=False`); the caller closes it."""
        try:
            stream = await anyio.connect_unix(self.socket_path)
        except OSError as exc:
            raise _unreachable(self.socket_path, exc) from None
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

    # Raw access

    async def request(self, req: RawRequest, *, hello: bool = True) -> Reply:
        async with self.connect(hello=hello) as conn:
            return await conn.request(req)

    async def stream(self, req: RawRequest, *, hello: bool = True) -> list[Reply]:
        """All replies of one streaming request (it must end: do not pass follow=True)."""
        async with self.connect(hello=hello) as conn:
            return [reply async for reply in conn.stream(req)]

    async def send_raw(self, data: bytes, *, hello: bool = True, expect: int | None = None) -> list[dict[str, Any]]:
        async with self.connect(hello=hello) as conn:
            return await conn.send_raw_frames(data, expect=expect)

    # Operations

    async def hello(self) -> Any:
        async with self.connect(hello=False) as conn:
            return await conn.hello()

    async def submit(self, spec: JobSpec) -> str:
        result = await self._call(lambda i: Submit(id=i, spec=spec))
        return _convert(result, SubmitResult).job_id

    async def status(self, job_id: str) -> JobView:
        return _convert(await self._call(lambda i: Status(id=i, job_id=job_id)), JobView)

    async def list_jobs(self, *, all: bool = True, limit: int = 200) -> list[JobView]:
        return _convert(await self._call(lambda i: ListJobs(id=i, all=all, limit=limit)), list[JobView])

    async def cancel(self, job_id: str, force: bool = False) -> JobView:
        return _convert(await self._call(lambda i: Cancel(id=i, job_id=job_id, force=force)), JobView)

    async def wait(self, job_id: str) -> JobView:
        """Block until the job is final and return its view (wrap in `anyio.fail_after` to bound it)."""
        return _convert(await self._call(lambda i: Wait(id=i, job_id=job_id)), JobView)

    def logs(
        self, job_id: str, rank: int | None = None, attempt: int | None = None, follow: bool = False
    ) -> AsyncStream[LogChunk]:
        return AsyncStream(self, _logs_request(job_id, rank, attempt, follow), LogChunk)

    def events(self, job_id: str | None = None, follow: bool = False, since: int = 0) -> AsyncStream[EventView]:
        return AsyncStream(self, _events_request(job_id, follow, since), EventView)

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
        return _convert(await self._call(lambda i: DaemonInfoReq(id=i)), DaemonInfo)

    async def reload(self) -> None:
        await self._call(lambda i: Reload(id=i))


# Blocking


class Connection:
    """One open control connection over a blocking socket; requests go one after another."""

    def __init__(self, sock: socket.socket, socket_path: Path) -> None:
        self.socket_path = socket_path
        self._sock = sock
        self._splitter = LineSplitter(MAX_FRAME)
        self._lines: list[bytes] = []
        self._eof = False
        self._ids = itertools.count(1)

    def next_id(self) -> int:
        return next(self._ids)

    def send_raw(self, data: bytes) -> None:
        try:
            self._sock.sendall(data)
        except OSError as exc:
            raise ConnectionLost(self.socket_path, f"sending failed: {exc}") from None

    def send(self, req: RawRequest) -> Any:
        req = _with_id(req, self.next_id())
        self.send_raw(_encode(req))
        return _id_of(req)

    def receive_line(self) -> bytes | None:
        while not self._lines:
            if self._eof:
                return None
            try:
                data = self._sock.recv(_READ_SIZE)
            except OSError as exc:
                raise ConnectionLost(self.socket_path, str(exc)) from None
            if not data:
                self._eof = True
                continue
            try:
                self._lines.extend(self._splitter.feed(data))
            except FrameError:
                raise ProtocolError(f"reply frame exceeds {MAX_FRAME} bytes") from None
        return self._lines.pop(0)

    def receive(self) -> Reply:
        line = self.receive_line()
        if line is None:
            raise ConnectionLost(self.socket_path)
        return _parse_reply(line)

    def request(self, req: RawRequest) -> Reply:
        req_id = self.send(req)
        return _check_id(self.receive(), req_id)

    def call(self, req: RawRequest) -> Any:
        return _result(self.request(req))

    def stream(self, req: RawRequest) -> Iterator[Reply]:
        req_id = self.send(req)
        while True:
            reply = _check_id(self.receive(), req_id)
            yield reply
            if not isinstance(reply, Item):
                return

    def send_raw_frames(self, data: bytes, *, expect: int | None = None) -> list[dict[str, Any]]:
        try:
            self._sock.sendall(data)
            if expect is None:
                self._sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the daemon may hang up on a bad frame; read what it said before that
        replies: list[dict[str, Any]] = []
        while expect is None or len(replies) < expect:
            try:
                line = self.receive_line()
            except ConnectionLost:
                line = None
            if line is None:
                break
            replies.append(_parse_raw(line))
        return replies

    def hello(self) -> Any:
        return self.call(_hello(self.next_id()))

    def close(self) -> None:
        """Close the connection; a read blocked in another thread wakes up with end of file."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


class Stream(Generic[T]):
    """The items of one follow-stream; connects on first use and closes at the end marker.

    Use it as `with client.logs(...) as chunks: for chunk in chunks: ...` so the connection is
    closed when the loop is left early.
    """

    def __init__(self, client: Client, make: RequestFactory, type_: type[T]) -> None:
        self._client = client
        self._make = make
        self._type = type_
        self._conn: Connection | None = None
        self._id = 0
        self._done = False

    def __iter__(self) -> Stream[T]:
        return self

    def __next__(self) -> T:
        if self._done:
            raise StopIteration
        try:
            if self._conn is None:
                self._conn = self._client.open()
                self._id = self._conn.next_id()
                self._conn.send(self._make(self._id))
            item = _stream_step(_check_id(self._conn.receive(), self._id), self._type)
        except BaseException:
            self.close()
            raise
        if item is None:
            self.close()
            raise StopIteration
        return item

    def close(self) -> None:
        self._done = True
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def __enter__(self) -> Stream[T]:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class Client:
    """Blocking client of the control socket (plain sockets, no event loop)."""

    def __init__(self, socket_path: str | Path | None = None) -> None:
        self.socket_path = Path(socket_path) if socket_path is not None else client_socket_path()

    def open(self, *, hello: bool = True) -> Connection:
        """A new connection (after the hello unless `hello=False`); the caller closes it."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(str(self.socket_path))
        except OSError as exc:
            sock.close()
            raise _unreachable(self.socket_path, exc) from None
        conn = Connection(sock, self.socket_path)
        if hello:
            try:
                conn.hello()
            except BaseException:
                conn.close()
                raise
        return conn

    @contextmanager
    def connect(self, *, hello: bool = True) -> Iterator[Connection]:
        conn = self.open(hello=hello)
        try:
            yield conn
        finally:
            conn.close()

    def _call(self, make: RequestFactory) -> Any:
        with self.connect() as conn:
            return conn.call(make(conn.next_id()))

    # Raw access

    def request(self, req: RawRequest, *, hello: bool = True) -> Reply:
        with self.connect(hello=hello) as conn:
            return conn.request(req)

    def stream(self, req: RawRequest, *, hello: bool = True) -> list[Reply]:
        """All replies of one streaming request (it must end: do not pass follow=True)."""
        with self.connect(hello=hello) as conn:
            return list(conn.stream(req))

    def send_raw(self, data: bytes, *, hello: bool = True, expect: int | None = None) -> list[dict[str, Any]]:
        with self.connect(hello=hello) as conn:
            return conn.send_raw_frames(data, expect=expect)

    # Operations

    def hello(self) -> Any:
        with self.connect(hello=False) as conn:
            return conn.hello()

    def submit(self, spec: JobSpec) -> str:
        return _convert(self._call(lambda i: Submit(id=i, spec=spec)), SubmitResult).job_id

    def status(self, job_id: str) -> JobView:
        return _convert(self._call(lambda i: Status(id=i, job_id=job_id)), JobView)

    def list_jobs(self, *, all: bool = True, limit: int = 200) -> list[JobView]:
        return _convert(self._call(lambda i: ListJobs(id=i, all=all, limit=limit)), list[JobView])

    def cancel(self, job_id: str, force: bool = False) -> JobView:
        return _convert(self._call(lambda i: Cancel(id=i, job_id=job_id, force=force)), JobView)

    def wait(self, job_id: str) -> JobView:
        return _convert(self._call(lambda i: Wait(id=i, job_id=job_id)), JobView)

    def logs(
        self, job_id: str, rank: int | None = None, attempt: int | None = None, follow: bool = False
    ) -> Stream[LogChunk]:
        return Stream(self, _logs_request(job_id, rank, attempt, follow), LogChunk)

    def events(self, job_id: str | None = None, follow: bool = False, since: int = 0) -> Stream[EventView]:
        return Stream(self, _events_request(job_id, follow, since), EventView)

    def ping(self) -> float:
        with self.connect() as conn:
            start = time.perf_counter()
            result = conn.call(Ping(id=conn.next_id()))
            elapsed = time.perf_counter() - start
        if result != "pong":
            raise ProtocolError(f"ping answered {result!r}")
        return elapsed

    def daemon_info(self) -> DaemonInfo:
        return _convert(self._call(lambda i: DaemonInfoReq(id=i)), DaemonInfo)

    def reload(self) -> None:
        self._call(lambda i: Reload(id=i))
