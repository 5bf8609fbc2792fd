"""The control server: one task per client connection, NDJSON requests, replies and streams.

Nothing a client sends reaches the root task group. A request is bounded before it is parsed
(MAX_REQUEST bytes, nesting depth, every field typed and ranged), read against an idle and a
partial-frame deadline, and answered with an error of a stable code naming the problem. A bug met
while serving one connection is logged as `control.internal_error`, answered `internal`, and
closes that connection only. At most `max_connections` are served at once, at most
`max_connections_per_user` of one uid, and the last few are kept for root and the admin group
(`door`); a `wait` or a followed stream ends when its peer closes.
"""

from __future__ import annotations

import grp
import os
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import anyio
import structlog
from anyio.abc import SocketAttribute, SocketStream

from ...protocol import MAX_REQUEST, Decoder, ErrorCode, FrameError, encode
from ...protocol.control import (
    OPS,
    DaemonInfo,
    End,
    Error,
    Events,
    Item,
    Logs,
    Ok,
    Reply,
    Request,
    RequestEnvelope,
    Wait,
    reply_id,
)
from ...protocol.limits import clip_text
from ...protocol.paths import UnsafeSocketDir, make_runtime_dir, user_runtime_dir
from ..pool.pool import WarmPool
from ..queue.facade import Jobs
from ..store.curves import CurveStore
from ..store.errors import DaemonError
from ..store.private import make_dirs
from . import handlers
from .door import Door, Privilege, is_daemon_user, peer_closed
from .handlers import Context, Services
from .interpreters import InterpreterChecks
from .poolview import PoolServers
from .requests import FrameReader, ReadTimeout

log = structlog.get_logger("ddpd")

_envelope: Decoder[RequestEnvelope] = Decoder(RequestEnvelope, limit=MAX_REQUEST)
_request: Decoder[Request] = Decoder(Request, limit=MAX_REQUEST)
REFUSAL_LOG_INTERVAL = 10.0
MESSAGE_LIMIT = 2000  # characters of an error message (it may quote what the client sent)


def peer_uid(stream: SocketStream) -> int:
    sock: socket.socket = stream.extra(SocketAttribute.raw_socket)
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return int(uid)


def prepare_socket_path(path: Path) -> None:
    """Refuse to steal the socket of a live daemon; remove a stale one. The default per-user runtime
    directory is created 0700 and refused when someone else controls it (they could take the socket)."""
    if path.parent == user_runtime_dir():
        try:
            make_runtime_dir(path.parent)
        except UnsafeSocketDir as exc:
            raise OSError(str(exc)) from None
    make_dirs(path.parent)  # 0755 where it creates one (the daemon's umask is 077): others connect
    if path.exists() or path.is_symlink():
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()
        else:
            raise OSError(f"another daemon is already listening on {path}")
        finally:
            probe.close()


def secure_socket(path: Path, mode: int, group: str | None) -> None:
    if group is not None:
        os.chown(path, -1, grp.getgrnam(group).gr_gid)
    os.chmod(path, mode)


class ControlServer:
    def __init__(self, jobs: Jobs, services: Services, info: Callable[[], DaemonInfo],
                 reload: Callable[[], Awaitable[None]], curves: CurveStore | None = None,
                 pool: WarmPool | None = None) -> None:
        self.jobs = jobs
        self.live = live = services.live  # the daemon's current config (a reload changes the limits)
        self.curves = curves
        self.info = info
        self.reload = reload
        self.context = Context(jobs, services, info, reload, curves, InterpreterChecks(
            services.subtree, lambda: live.current.interpreter_checks_per_user), PoolServers(pool))
        self.door = Door()
        self.privilege = Privilege()
        self.refused = 0  # connections refused for max_connections since start
        self._refusal_logged = float("-inf")

    async def handle(self, stream: SocketStream) -> None:
        """Serve one connection; never raises but cancellation."""
        try:
            async with stream:
                try:
                    uid = peer_uid(stream)
                except OSError:
                    return
                refusal = await self._admission(uid)
                if refusal is not None:
                    self._refused(uid)
                    await self._send(stream, Error(id=None, code=ErrorCode.LIMIT_EXCEEDED, message=refusal),
                                     timeout=1.0)
                    return
                self.door.enter(uid)
                try:
                    await self._serve(stream, uid)
                finally:
                    self.door.leave(uid)
        except Exception:  # a bug: this connection ends, the daemon and the others go on
            log.exception("control.internal_error")

    @property
    def connections(self) -> int:
        return self.door.total

    async def _admission(self, uid: int) -> str | None:
        """Why a connection of `uid` is refused now (see `door.Door`), or None; the admin group is
        looked up only for a connection that would otherwise be refused."""
        cfg = self.live.current
        limits = (cfg.max_connections, cfg.max_connections_per_user)
        refusal = self.door.refusal(uid, is_daemon_user(uid), *limits)
        if refusal is None or is_daemon_user(uid) or not await self.privilege.of(uid, cfg.admin_group):
            return refusal
        return self.door.refusal(uid, True, *limits)

    def _refused(self, uid: int) -> None:
        """Log refusals at most every REFUSAL_LOG_INTERVAL seconds (a flood must not flood the log)."""
        self.refused += 1
        now = anyio.current_time()
        if now - self._refusal_logged >= REFUSAL_LOG_INTERVAL:
            self._refusal_logged = now
            log.warning("control.connections_refused", open=self.connections, uid=uid, of_uid=self.door.open[uid],
                        max_connections=self.live.current.max_connections, refused=self.refused)

    async def _serve(self, stream: SocketStream, uid: int) -> None:
        reader = FrameReader(stream, MAX_REQUEST)
        while True:
            cfg = self.live.current
            try:
                line = await reader.next_frame(cfg.idle_timeout, cfg.frame_timeout)
            except FrameError as exc:
                await self._send(stream, Error(id=None, code=exc.code, message=exc.message), timeout=1.0)
                return
            except ReadTimeout as exc:
                log.info("control.connection_timeout", uid=uid, partial=exc.partial)
                await self._send(stream, Error(id=None, code=ErrorCode.TIMEOUT, message=str(exc)), timeout=1.0)
                return
            if line is None or not await self._serve_line(stream, line, uid):
                return

    async def _send(self, stream: SocketStream, reply: Reply, timeout: float | None = None) -> bool:
        """Send one reply; False when the client is gone or does not read it within the timeout."""
        try:
            data = encode(reply)
        except FrameError as exc:  # a result too large for one frame (replies are bounded: a bug)
            log.error("control.reply_too_large", error=exc.message)
            data = encode(Error(id=reply.id, code=ErrorCode.INTERNAL, message=exc.message))
        with anyio.move_on_after(self.live.current.idle_timeout if timeout is None else timeout):
            try:
                await stream.send(data)
                return True
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                return False
        return False

    async def _serve_line(self, stream: SocketStream, line: bytes, uid: int) -> bool:
        """Answer one request; False closes the connection."""
        if not line.strip():
            return True
        try:
            env = _envelope.decode_frame(line)
        except FrameError as exc:
            return await self._send(stream, Error(id=None, code=exc.code, message=clip_text(exc.message,
                                                                                           MESSAGE_LIMIT)))
        rid = reply_id(env.id)
        if env.op not in OPS:
            return await self._send(stream, Error(id=rid, code=ErrorCode.UNKNOWN_OPERATION,
                                                  message=clip_text(f"unknown operation {env.op!r}", MESSAGE_LIMIT)))
        try:
            req = _request.decode_frame(line)
        except FrameError as exc:
            return await self._send(stream, Error(id=rid, code=exc.code, message=clip_text(exc.message,
                                                                                          MESSAGE_LIMIT)))
        try:
            if not await self._answer(stream, req, uid):
                return False
        except DaemonError as exc:  # an expected failure, with its code (store.errors)
            return await self._send(stream, Error(id=rid, code=exc.code, message=clip_text(exc.message,
                                                                                          MESSAGE_LIMIT)))
        except Exception as exc:  # a bug
            log.exception("control.internal_error", op=env.op, uid=uid)
            await self._send(stream, Error(id=rid, code=ErrorCode.INTERNAL,
                                           message=clip_text(repr(exc), MESSAGE_LIMIT)), timeout=1.0)
            return False
        return True

    async def _answer(self, stream: SocketStream, req: Request, uid: int) -> bool:
        """Send every reply to `req`; False when the client is gone. A `wait` or a followed stream also
        ends as soon as its peer closes (it would hold its connection slot until the job ends)."""
        if not (isinstance(req, Wait) or (isinstance(req, Logs | Events) and req.follow)):
            async for reply in self._dispatch(req, uid):
                if not await self._send(stream, reply):
                    return False
            return True
        gone, failure = False, None
        async with anyio.create_task_group() as tg:
            async def watch() -> None:
                nonlocal gone
                await peer_closed(stream.extra(SocketAttribute.raw_socket))
                gone = True
                tg.cancel_scope.cancel()

            tg.start_soon(watch)
            try:
                async for reply in self._dispatch(req, uid):
                    if not await self._send(stream, reply):
                        gone = True
                        break
            except Exception as exc:  # raised as itself below, not inside the task group's ExceptionGroup
                failure = exc
            tg.cancel_scope.cancel()
        if failure is not None:
            raise failure
        return not gone

    async def _dispatch(self, req: Request, uid: int) -> AsyncIterator[Reply]:
        """The replies to `req`: its handler's result as Ok, or its items and then End (see handlers)."""
        answer = handlers.route(self.context, req, uid)
        if not isinstance(answer, AsyncIterator):
            yield Ok(id=req.id, result=await answer)
            return
        async for item in answer:
            yield Item(id=req.id, item=item)
        yield End(id=req.id)
