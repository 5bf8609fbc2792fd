"""The blocking `Client`: the async core run on a private event loop thread (anyio's blocking portal).

Each call starts a portal, runs the `AsyncClient` coroutine there and waits for it; a stream or
a `connect()` connection keeps its portal until it is closed. So a blocking client works from any
plain thread, several at once, and needs no closing of its own. A KeyboardInterrupt (Ctrl-C) in
the waiting thread cancels the coroutine, which closes its connection, and is re-raised at once.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any, Generic, Protocol, TypeVar

from anyio.from_thread import BlockingPortal, start_blocking_portal

from ddpd.protocol import JobSpec
from ddpd.protocol.control import (
    CancelResult,
    CurveResult,
    DaemonInfo,
    EventView,
    GpuReleaseResult,
    JobPage,
    JobView,
    LogChunk,
    Reply,
    ShareResult,
    StacksResult,
    SubmitResult,
    WhoAmI,
)
from ddpd.protocol.logquery import Stream as LogStream

from .aio import AsyncClient, AsyncConnection
from .wire import RawRequest

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class _AsyncItems(Protocol[T_co]):
    """What a blocking Stream runs: an AsyncStream, or an async generator such as `iter_jobs`."""

    def __anext__(self) -> Awaitable[T_co]: ...

    def aclose(self) -> Awaitable[None]: ...


def _wait(portal: BlockingPortal, func: Callable[[], Awaitable[T]]) -> T:
    """Run `func` in the portal and wait; anything raised in this thread (Ctrl-C) cancels it."""

    async def run() -> T:
        return await func()

    future = portal.start_task_soon(run)
    try:
        return future.result()
    except BaseException:
        future.cancel()
        raise


def _once(func: Callable[[], Awaitable[T]]) -> T:
    with start_blocking_portal(name="ddpd-client") as portal:
        return _wait(portal, func)


class _End:
    pass


_END = _End()


class Stream(Generic[T]):
    """The items of one follow-stream; connects on first use and closes at the end marker.

    Use it as `with client.logs(...) as chunks: for chunk in chunks: ...` so the connection is
    closed when the loop is left early. One thread reads it at a time.
    """

    def __init__(self, stream: _AsyncItems[T]) -> None:
        self._stream = stream
        self._exit = ExitStack()
        self._portal: BlockingPortal | None = None
        self._done = False

    def __iter__(self) -> Stream[T]:
        return self

    def __next__(self) -> T:
        if self._done:
            raise StopIteration
        if self._portal is None:
            self._portal = self._exit.enter_context(start_blocking_portal(name="ddpd-client-stream"))

        async def step() -> T | _End:
            try:
                return await self._stream.__anext__()
            except StopAsyncIteration:
                return _END

        try:
            item = _wait(self._portal, step)
        except BaseException:
            self.close()
            raise
        if isinstance(item, _End):
            self.close()
            raise StopIteration
        return item

    def close(self) -> None:
        self._done = True
        portal, self._portal = self._portal, None
        if portal is not None:
            try:
                portal.call(self._stream.aclose)
            finally:
                self._exit.close()

    def __enter__(self) -> Stream[T]:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class Connection:
    """One open control connection, used from one thread; requests go one after another."""

    def __init__(self, portal: BlockingPortal, conn: AsyncConnection, exit: ExitStack) -> None:
        self.socket_path = conn.socket_path
        self._portal = portal
        self._conn = conn
        self._exit = exit

    def next_id(self) -> int:
        return self._conn.next_id()

    def request(self, req: RawRequest) -> Reply:
        return _wait(self._portal, lambda: self._conn.request(req))

    def call(self, req: RawRequest) -> Any:
        return _wait(self._portal, lambda: self._conn.call(req))

    def stream(self, req: RawRequest) -> Iterator[Reply]:
        """Send one streaming request and yield its replies, the final End or Error included."""
        replies: AsyncIterator[Reply] = self._conn.stream(req)
        while True:
            try:
                reply = _wait(self._portal, replies.__anext__)
            except StopAsyncIteration:
                return
            yield reply

    def hello(self) -> Any:
        return _wait(self._portal, self._conn.hello)

    def close(self) -> None:
        try:
            self._portal.call(self._conn.aclose)
        finally:
            self._exit.close()


class Client:
    """Blocking client of the control socket: the methods of `AsyncClient`, without an event loop.

    `aio` is the AsyncClient it runs.
    """

    def __init__(self, socket_path: str | Path | None = None) -> None:
        self.aio = AsyncClient(socket_path)
        self.socket_path = self.aio.socket_path

    def open(self, *, hello: bool = True) -> Connection:
        """A new connection (after the hello unless `hello=False`); the caller closes it."""
        exit = ExitStack()
        portal = exit.enter_context(start_blocking_portal(name="ddpd-client-connection"))
        try:
            conn = _wait(portal, lambda: self.aio.open(hello=hello))
        except BaseException:
            exit.close()
            raise
        return Connection(portal, conn, exit)

    @contextmanager
    def connect(self, *, hello: bool = True) -> Iterator[Connection]:
        conn = self.open(hello=hello)
        try:
            yield conn
        finally:
            conn.close()

    def hello(self) -> Any:
        return _once(self.aio.hello)

    def submit(self, spec: JobSpec, *, idempotency_key: str | None = None) -> str:
        return _once(lambda: self.aio.submit(spec, idempotency_key=idempotency_key))

    def submit_result(self, spec: JobSpec, *, idempotency_key: str | None = None) -> SubmitResult:
        return _once(lambda: self.aio.submit_result(spec, idempotency_key=idempotency_key))

    def resubmit(self, job_id: str, *, idempotency_key: str | None = None) -> SubmitResult:
        return _once(lambda: self.aio.resubmit(job_id, idempotency_key=idempotency_key))

    def status(self, job_id: str) -> JobView:
        return _once(lambda: self.aio.status(job_id))

    def list_page(self, *, all: bool = True, limit: int = 200, before: int | None = None) -> JobPage:
        return _once(lambda: self.aio.list_page(all=all, limit=limit, before=before))

    def list_jobs(self, *, all: bool = True, limit: int = 200, before: int | None = None) -> list[JobView]:
        return _once(lambda: self.aio.list_jobs(all=all, limit=limit, before=before))

    def iter_jobs(self, *, all: bool = True, page_size: int = 200) -> Stream[JobView]:
        """Every job, newest first, a page at a time."""
        return Stream(self.aio.iter_jobs(all=all, page_size=page_size))

    def cancel(self, job_id: str, force: bool = False) -> CancelResult:
        return _once(lambda: self.aio.cancel(job_id, force))

    def remove(self, job_id: str) -> str:
        return _once(lambda: self.aio.remove(job_id))

    def wait(self, job_id: str) -> JobView:
        return _once(lambda: self.aio.wait(job_id))

    def logs(
        self, job_id: str, rank: int | None = None, attempt: int | None = None, follow: bool = False, *,
        ranks: list[int] | None = None, stream: LogStream = "both", tail: int | None = None,
        since: float | None = None,
    ) -> Stream[LogChunk]:
        return Stream(self.aio.logs(job_id, rank, attempt, follow, ranks=ranks, stream=stream, tail=tail,
                                    since=since))

    def events(self, job_id: str | None = None, follow: bool = False, since: int = 0) -> Stream[EventView]:
        return Stream(self.aio.events(job_id, follow, since))

    def stacks(self, job_id: str, rank: int | None = None, native: bool = False) -> StacksResult:
        return _once(lambda: self.aio.stacks(job_id, rank, native))

    def curve(self, job_id: str) -> CurveResult:
        return _once(lambda: self.aio.curve(job_id))

    def ping(self) -> float:
        return _once(self.aio.ping)

    def daemon_info(self) -> DaemonInfo:
        return _once(self.aio.daemon_info)

    def reload(self) -> None:
        _once(self.aio.reload)

    def gpu_release(self, gpu: str) -> GpuReleaseResult:
        return _once(lambda: self.aio.gpu_release(gpu))

    def share(self) -> ShareResult:
        return _once(self.aio.share)

    def whoami(self) -> WhoAmI:
        return _once(self.aio.whoami)
