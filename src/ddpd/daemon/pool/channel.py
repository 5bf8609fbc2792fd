"""The daemon's end of a worker channel: non-blocking socket, NDJSON frames, no polling.

Any byte stream a worker sends becomes frames or a FrameError, never another exception.

Reading costs one `recv` per readiness of the socket and nothing else: the socket stays registered
with the event loop (asyncio's `add_reader`, the loop anyio runs the daemon on) for as long as its
frames are wanted, and the loop's callback reads, splits and decodes what came into a queue the
reader drains (a wait per frame would register and unregister the socket each time: two
`epoll_ctl`, an extra `recv` and an exception per frame, most of the daemon's cost at 500 ranks).
A reader may also take frames in the callback itself (`frames(quick=...)`): while it is waiting with
nothing queued, a frame it can apply at once (a heartbeat: memory only) is applied there and
nothing wakes. The queue is bounded: past QUEUE_LIMIT frames the socket is no longer read until the
reader catches up, so a flooding worker waits on its own send, as a blocking read would make it.

Sending never waits on the worker for long: a worker that does not read (stopped, or stuck with
its socket full) makes a send give up after SEND_WAIT, as if the worker were gone; the frame's
caller (a stop, a dump, a re-form) goes on with its own deadline.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import socket
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence

import anyio

from ...protocol import Decoder, FrameError, LineSplitter, encode
from ...protocol.channel import DaemonMessage, WorkerMessage
from ..contain.procs import wait_gone

QUEUE_LIMIT = 256  # frames read but not yet taken: past this the socket is not read
SEND_WAIT = 5.0  # seconds one send waits for a worker to make room in its socket
READ_SIZE = 1 << 16

_decoder: Decoder[WorkerMessage] = Decoder(WorkerMessage)


class _End:
    """The worker closed its end (or the socket failed): no more frames."""


_END = _End()
Quick = Callable[[WorkerMessage], bool]  # True: the frame was applied and is not queued


class WorkerChannel:
    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock
        self._splitter = LineSplitter()
        self.closed = False
        self._queue: deque[WorkerMessage | FrameError | _End] = deque()
        self._loop: asyncio.AbstractEventLoop | None = None  # where the socket is registered, while it is
        self._ended = False  # the end was read: the socket is never registered again
        self._waiter: asyncio.Future[None] | None = None  # the reader, waiting for the queue
        self._quick: Quick | None = None

    async def frames(self, quick: Quick | None = None) -> AsyncIterator[WorkerMessage]:
        """Yield decoded frames until EOF; a bad frame raises FrameError (in its place in the stream).

        `quick`, while this reader waits with nothing queued, is offered each frame in the event
        loop's callback; a frame it returns True for was applied there and is not yielded."""
        loop = asyncio.get_running_loop()
        self._quick = quick
        try:
            while not self.closed:
                if not self._queue:
                    self._listen(loop)
                    self._waiter = loop.create_future()
                    try:
                        await self._waiter
                    finally:
                        self._waiter = None
                    continue
                item = self._queue.popleft()
                if isinstance(item, _End):
                    self._queue.appendleft(item)  # a later reader ends too
                    return
                if isinstance(item, FrameError):
                    raise item
                yield item
        finally:
            if self._quick is quick:  # (a reader left behind unfinished is finalised later: not another's)
                self._quick = None

    async def first_frame(self, pid: int) -> WorkerMessage | None:
        """The first frame (the rest stays for the next reader); None at the channel's end, a bad
        frame, or once process `pid` (the worker) has exited, whichever comes first. Not only the
        channel's end: what the worker left behind may hold its end open (a `setsid` child of a user's
        interpreter wrapper inherits it), and a pool worker that died before its Hello was then
        never reaped, its cgroup and the escapee in it kept until the daemon stopped."""
        frame: WorkerMessage | None = None
        async with anyio.create_task_group() as tg:
            async def read() -> None:
                nonlocal frame
                with contextlib.suppress(FrameError):
                    async for first in self.frames():
                        frame = first
                        break
                tg.cancel_scope.cancel()

            async def gone() -> None:
                await wait_gone(pid)
                tg.cancel_scope.cancel()

            tg.start_soon(read)
            tg.start_soon(gone)
        return frame

    def _listen(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._loop is None and not self._ended and not self.closed:
            loop.add_reader(self.sock.fileno(), self._readable)
            self._loop = loop

    def _unlisten(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self.sock.fileno())
            self._loop = None

    def _readable(self) -> None:
        """The event loop's callback: read what came, queue its frames (or apply them, `quick`)."""
        try:
            data = self.sock.recv(READ_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._ended = True
            self._unlisten()
            self._queue.append(_END)
        else:
            error: FrameError | None = None
            try:
                lines = self._splitter.feed(data)
            except FrameError as exc:
                lines, error = [], exc
            quick = self._quick if self._waiter is not None else None
            for line in lines:
                try:
                    message = _decoder.decode_frame(line)
                except FrameError as exc:
                    self._queue.append(exc)
                    continue
                except RecursionError:  # msgspec's own error for deep nesting is not a DecodeError
                    self._queue.append(FrameError("malformed_frame", "frame nested too deeply"))
                    continue
                if quick is not None and not self._queue and quick(message):
                    continue
                self._queue.append(message)
            if error is not None:
                self._queue.append(error)
            if len(self._queue) >= QUEUE_LIMIT:
                self._unlisten()  # the reader registers the socket again once it has taken them all
        if self._queue and self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def send(self, message: DaemonMessage, fds: Sequence[int] = ()) -> bool:
        """Send one frame (`fds` go with its first byte, SCM_RIGHTS); False when the worker is gone or
        does not make room for it within SEND_WAIT."""
        data = memoryview(encode(message))
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
        while data:
            try:
                sent = self.sock.sendmsg([data], rights) if rights else self.sock.send(data)
                rights = []
            except BlockingIOError:
                with anyio.move_on_after(SEND_WAIT) as waited:
                    await anyio.wait_writable(self.sock)
                if waited.cancelled_caught:
                    return False  # a worker that reads nothing (stopped, or stuck): as good as gone
                continue
            except OSError:
                return False
            data = data[sent:]
        return True

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._unlisten()
            if self._waiter is not None and not self._waiter.done():
                self._waiter.set_result(None)
            self.sock.close()


__all__ = ["FrameError", "WorkerChannel"]
