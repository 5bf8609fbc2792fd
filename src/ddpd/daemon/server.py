"""The control server: one task per client connection, NDJSON requests, replies and streams."""

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
from anyio.streams.buffered import BufferedByteReceiveStream

from .. import __version__
from ..protocol import MAX_FRAME, PROTOCOL_VERSION, Decoder, ErrorCode, FrameError, SpecError, encode
from ..protocol.control import (
    Cancel,
    DaemonInfo,
    DaemonInfoReq,
    End,
    Error,
    Events,
    EventView,
    HelloReq,
    Item,
    ListJobs,
    LogChunk,
    Logs,
    Ok,
    Ping,
    Reload,
    Reply,
    Request,
    RequestEnvelope,
    Status,
    Submit,
    SubmitResult,
    Wait,
)
from .errors import DaemonError
from .jobs import Job, rank_log
from .scheduler import Scheduler

log = structlog.get_logger("ddpd")

_envelope: Decoder[RequestEnvelope] = Decoder(RequestEnvelope)
_request: Decoder[Request] = Decoder(Request)
_OPS = {"hello", "submit", "status", "list", "cancel", "wait", "logs", "events", "ping", "daemon", "reload"}
LOG_CHUNK = 256 * 1024
FOLLOW_INTERVAL = 0.2


class RequestError(Exception):
    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def peer_uid(stream: SocketStream) -> int:
    sock: socket.socket = stream.extra(SocketAttribute.raw_socket)
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return int(uid)


def prepare_socket_path(path: Path) -> None:
    """Refuse to steal the socket of a live daemon; remove a stale one."""
    path.parent.mkdir(parents=True, exist_ok=True)
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
    def __init__(self, scheduler: Scheduler, info: Callable[[], DaemonInfo],
                 reload: Callable[[], Awaitable[None]]) -> None:
        self.scheduler = scheduler
        self.info = info
        self.reload = reload

    async def handle(self, stream: SocketStream) -> None:
        async with stream:
            try:
                uid = peer_uid(stream)
            except OSError:
                return
            reader = BufferedByteReceiveStream(stream)
            while True:
                try:
                    line = await reader.receive_until(b"\n", MAX_FRAME)
                except anyio.DelimiterNotFound:
                    await self._send(stream, Error(id=None, code=ErrorCode.FRAME_TOO_LARGE,
                                                   message=f"frame exceeds {MAX_FRAME} bytes; closing"))
                    return
                except (anyio.IncompleteRead, anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                    return
                if not await self._serve_line(stream, line, uid):
                    return

    async def _send(self, stream: SocketStream, reply: Reply) -> bool:
        try:
            await stream.send(encode(reply))
            return True
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            return False
        except FrameError as exc:  # a result too large for one frame
            return await self._send(stream, Error(id=reply.id, code=ErrorCode.INTERNAL, message=exc.message))

    async def _serve_line(self, stream: SocketStream, line: bytes, uid: int) -> bool:
        if not line.strip():
            return True
        try:
            env = _envelope.decode_frame(line)
        except FrameError as exc:
            return await self._send(stream, Error(id=None, code=exc.code, message=exc.message))
        if env.op not in _OPS:
            return await self._send(stream, Error(id=env.id, code=ErrorCode.UNKNOWN_OPERATION,
                                                  message=f"unknown operation {env.op!r}"))
        try:
            req = _request.decode_frame(line)
        except FrameError as exc:
            return await self._send(stream, Error(id=env.id, code=exc.code, message=exc.message))
        try:
            async for reply in self._dispatch(req, uid):
                if not await self._send(stream, reply):
                    return False
        except RequestError as exc:
            return await self._send(stream, Error(id=req.id, code=exc.code, message=exc.message))
        except SpecError as exc:
            return await self._send(stream, Error(id=req.id, code=ErrorCode.BAD_SPEC, message=str(exc)))
        except DaemonError as exc:
            return await self._send(stream, Error(id=req.id, code=exc.code, message=exc.message))
        except Exception as exc:  # a bug must not take the daemon down with one client
            log.exception("control.internal_error", op=env.op)
            return await self._send(stream, Error(id=req.id, code=ErrorCode.INTERNAL, message=repr(exc)))
        return True

    def _job(self, job_id: str) -> Job:
        job = self.scheduler.jobs.get(job_id)
        if job is None:
            raise RequestError(ErrorCode.NOT_FOUND, f"no job {job_id!r}")
        return job

    async def _dispatch(self, req: Request, uid: int) -> AsyncIterator[Reply]:
        rid = req.id
        match req:
            case HelloReq(version=version):
                if version != PROTOCOL_VERSION:
                    raise RequestError(ErrorCode.VERSION_MISMATCH,
                                       f"client speaks protocol {version}, daemon {PROTOCOL_VERSION}")
                yield Ok(id=rid, result={"version": PROTOCOL_VERSION, "daemon": __version__})
            case Submit(spec=spec):
                if not self.scheduler.accepting:
                    raise RequestError(ErrorCode.SHUTTING_DOWN, "the daemon is shutting down")
                job, existing = await self.scheduler.submit(spec, uid, req.idempotency_key)
                yield Ok(id=rid, result=SubmitResult(job_id=job.id, existing=existing))
            case Status(job_id=job_id):
                yield Ok(id=rid, result=self._job(job_id).view())
            case ListJobs(limit=limit):
                jobs = sorted(self.scheduler.jobs.values(), key=lambda j: j.seq)[-limit:]
                yield Ok(id=rid, result=[j.view() for j in jobs])
            case Cancel(job_id=job_id, force=force):
                job = self._job(job_id)
                if uid not in (0, job.owner_uid):
                    raise RequestError(ErrorCode.PERMISSION_DENIED,
                                       f"job {job_id} belongs to uid {job.owner_uid}; only it or root may cancel")
                if job.state.final:
                    raise RequestError(ErrorCode.NOT_RUNNABLE, f"job {job_id} already ended ({job.state.value})")
                await self.scheduler.cancel(job, f"cancelled by uid {uid}", force)
                yield Ok(id=rid, result=job.view())
            case Wait(job_id=job_id):
                job = self._job(job_id)
                await job.finished.wait()
                yield Ok(id=rid, result=job.view())
            case Logs():
                async for chunk in self._logs(req):
                    yield Item(id=rid, item=chunk)
                yield End(id=rid)
            case Events():
                async for event in self._events(req):
                    yield Item(id=rid, item=event)
                yield End(id=rid)
            case Ping():
                yield Ok(id=rid, result="pong")
            case DaemonInfoReq():
                yield Ok(id=rid, result=self.info())
            case Reload():
                await self.reload()
                yield Ok(id=rid, result=None)

    async def _logs(self, req: Logs) -> AsyncIterator[LogChunk]:
        job = self._job(req.job_id)
        attempt = req.attempt or job.attempt
        if req.rank is not None and not 0 <= req.rank < job.spec.nproc:
            raise RequestError(ErrorCode.NOT_FOUND, f"job {job.id} has no rank {req.rank}")
        ranks = [req.rank] if req.rank is not None else list(range(job.spec.nproc))
        offsets = dict.fromkeys(ranks, 0)

        def read_new() -> list[LogChunk]:
            out: list[LogChunk] = []
            for r in ranks:
                path = rank_log(self.scheduler.config.state_dir, job.id, attempt, r)
                try:
                    with open(path, "rb") as f:
                        f.seek(offsets[r])
                        data = f.read(LOG_CHUNK)
                except FileNotFoundError:
                    continue
                if data:
                    offsets[r] += len(data)
                    out.append(LogChunk(rank=r, attempt=attempt, text=data.decode("utf-8", "replace")))
            return out

        while True:
            done = job.finished.is_set() or (attempt != job.attempt)
            chunks = await anyio.to_thread.run_sync(read_new)
            for chunk in chunks:
                yield chunk
            if chunks:
                continue
            if req.follow and req.attempt is None and attempt != job.attempt:
                # the job started (attempt 0 is the queue) or restarted: follow its new attempt
                attempt = job.attempt
                offsets = dict.fromkeys(ranks, 0)
                continue
            if not req.follow or done:
                return
            with anyio.move_on_after(FOLLOW_INTERVAL):
                await job.finished.wait()

    async def _events(self, req: Events) -> AsyncIterator[EventView]:
        job = self._job(req.job_id) if req.job_id else None
        live = self.scheduler.journal.bus.subscribe() if req.follow else None
        try:
            last = req.since
            for event in await self.scheduler.journal.list_events(None if job is None else job.id, req.since,
                                                                  2**62):
                last = event.seq
                yield event
            if live is None or (job is not None and job.finished.is_set()):
                return
            async with live:
                async for event in live:
                    if event.seq and event.seq <= last:
                        continue
                    if job is not None and event.job_id != job.id:
                        continue
                    yield event
                    if job is not None and event.kind == "job.finished":
                        return
        finally:
            if live is not None:
                live.close()
