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
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import anyio
import msgspec
import structlog
from anyio.abc import SocketAttribute, SocketStream

from ... import __version__
from ...protocol import (
    MAX_REQUEST,
    PROTOCOL_VERSION,
    Decoder,
    ErrorCode,
    FrameError,
    JobSpec,
    SpecError,
    check_spec,
    encode,
)
from ...protocol.control import (
    LIST_LIMIT,
    Cancel,
    CancelResult,
    CurveReq,
    DaemonInfo,
    DaemonInfoReq,
    End,
    Error,
    Events,
    HelloReq,
    Item,
    ListJobs,
    Logs,
    Ok,
    Ping,
    Reload,
    Remove,
    Reply,
    Request,
    RequestEnvelope,
    Resubmit,
    StacksReq,
    Status,
    Submit,
    SubmitResult,
    Wait,
    reply_id,
)
from ...protocol.limits import clip_text
from ...protocol.paths import UnsafeSocketDir, make_runtime_dir, user_runtime_dir
from ...protocol.spec import reserved_env
from ..config import ConfigError
from ..contain.identity import Identity, UnknownUser, check_serves, job_environment
from ..gpu.gpuview import daemon_gpus, with_rank_gpus
from ..queue.jobids import resolve
from ..queue.scheduler import Scheduler
from ..store.curves import CurveStore, curve_result
from ..store.errors import DaemonError
from ..store.records import Job
from .door import Door, Privilege, is_daemon_user, peer_closed
from .interpreters import InterpreterChecks
from .replies import Detail, clip_event, fit_view, job_page, positioned, visible_view
from .requests import FrameReader, ReadTimeout
from .streams import job_events, log_chunks
from .visibility import detail_for, not_yours, visible_events

log = structlog.get_logger("ddpd")

_envelope: Decoder[RequestEnvelope] = Decoder(RequestEnvelope, limit=MAX_REQUEST)
_request: Decoder[Request] = Decoder(Request, limit=MAX_REQUEST)
_OPS = {"hello", "submit", "status", "list", "cancel", "wait", "logs", "events", "rm", "ping", "daemon", "reload",
        "stacks", "curve", "resubmit"}
REFUSAL_LOG_INTERVAL = 10.0
MESSAGE_LIMIT = 2000  # characters of an error message (it may quote what the client sent)


class RequestError(Exception):
    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def error_code(exc: BaseException) -> str | None:
    """The stable code of an expected failure; None for a bug (answered `internal`)."""
    if isinstance(exc, RequestError):
        return exc.code
    if isinstance(exc, FrameError):
        return exc.code
    if isinstance(exc, ConfigError):
        return ErrorCode.BAD_CONFIG
    if isinstance(exc, SpecError):
        return ErrorCode.BAD_SPEC
    if isinstance(exc, DaemonError):  # storage, limits, permissions, states: raised below the server
        return exc.code
    return None


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
                 reload: Callable[[], Awaitable[None]], curves: CurveStore | None = None) -> None:
        self.scheduler = scheduler
        self.curves = curves
        self.info = info
        self.reload = reload
        self.interpreters = InterpreterChecks(scheduler.subtree, lambda: scheduler.config.interpreter_checks_per_user)
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
        cfg = self.scheduler.config
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
                        max_connections=self.scheduler.config.max_connections, refused=self.refused)

    async def _serve(self, stream: SocketStream, uid: int) -> None:
        reader = FrameReader(stream, MAX_REQUEST)
        while True:
            cfg = self.scheduler.config
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
        with anyio.move_on_after(self.scheduler.config.idle_timeout if timeout is None else timeout):
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
        if env.op not in _OPS:
            return await self._send(stream, Error(id=rid, code=ErrorCode.UNKNOWN_OPERATION,
                                                  message=clip_text(f"unknown operation {env.op!r}", MESSAGE_LIMIT)))
        try:
            req = _request.decode_frame(line)
            if not await self._answer(stream, req, uid):
                return False
        except Exception as exc:
            code = error_code(exc)
            if code is None:
                log.exception("control.internal_error", op=env.op, uid=uid)
                await self._send(stream, Error(id=rid, code=ErrorCode.INTERNAL,
                                               message=clip_text(repr(exc), MESSAGE_LIMIT)), timeout=1.0)
                return False
            return await self._send(stream, Error(id=rid, code=code, message=clip_text(str(exc), MESSAGE_LIMIT)))
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

    async def _info_with_gpus(self) -> DaemonInfo:
        """The daemon's info with each GPU's memory, utilisation and holders (NVML; see gpuview)."""
        info = self.info()
        if info.gpus == 0:
            return info
        running = [j for j in self.scheduler.unended.values() if j.id in self.scheduler.running]
        devices, note = await daemon_gpus(running)
        return msgspec.structs.replace(info, gpu_devices=devices, gpu_note=note)

    async def _job(self, job_id: str) -> Job:
        """The job a request names: its id or a unique prefix (not_found, ambiguous: see jobids)."""
        return await resolve(self.scheduler.table, job_id)

    async def _owned(self, job_id: str, uid: int, what: str) -> Job:
        job = await self._job(job_id)
        if uid not in (0, job.owner_uid):
            raise RequestError(ErrorCode.PERMISSION_DENIED,
                               f"job {job.id} belongs to uid {job.owner_uid}; only it or root may {what} it")
        return job

    async def _identity(self, uid: int) -> Identity:
        try:
            return await anyio.to_thread.run_sync(Identity.of, uid)
        except UnknownUser as exc:
            raise RequestError(ErrorCode.PERMISSION_DENIED, str(exc)) from None

    async def _detail(self, uid: int) -> Detail:
        return await detail_for(uid, self.scheduler.config.admin_group)

    async def _detailed(self, job_id: str, uid: int, what: str) -> Job:
        """The job, if `uid` may see its detail (`what`: its logs, its events); else PERMISSION_DENIED."""
        job = await self._job(job_id)
        if not (await self._detail(uid))(job.owner_uid):
            raise RequestError(ErrorCode.PERMISSION_DENIED, not_yours(job, what))
        return job

    async def _check_submitter(self, spec: JobSpec, uid: int) -> None:
        """Who may submit (check_serves) and whether the job's interpreter runs for them (BAD_SPEC `python`)."""
        cfg = self.scheduler.config
        refusal = check_serves(os.geteuid(), uid, cfg.allow_root_jobs)
        if refusal is not None:
            raise RequestError(ErrorCode.PERMISSION_DENIED, refusal)
        python = spec.python
        if python is None and os.geteuid() == 0 and uid != 0 and not cfg.worker_command:
            python = sys.executable  # an older client of another user: its ranks run the daemon's, as that user
        if python is None:
            return  # an older client of the daemon's own user: the daemon's interpreter, as before
        identity = await self._identity(uid)
        exported = {k: v for k, v in (os.environ if spec.environ is None else spec.environ).items()
                    if not reserved_env(k)}
        env = job_environment(identity, exported, spec.env, {})
        reason = await self.interpreters.refusal(identity, python, env, cfg.interpreter_check_timeout)
        if reason is not None:
            raise SpecError("python", reason)

    async def _dispatch(self, req: Request, uid: int) -> AsyncIterator[Reply]:
        rid = req.id
        if os.geteuid() != 0 and uid != os.geteuid():  # a per-user daemon serves its own uid only
            refusal = check_serves(os.geteuid(), uid, self.scheduler.config.allow_root_jobs)
            raise RequestError(ErrorCode.PERMISSION_DENIED, refusal or "not served")
        match req:
            case HelloReq(version=version):
                if version != PROTOCOL_VERSION:
                    raise RequestError(ErrorCode.VERSION_MISMATCH,
                                       f"client speaks protocol {version}, daemon {PROTOCOL_VERSION}")
                yield Ok(id=rid, result={"version": PROTOCOL_VERSION, "daemon": __version__})
            case Submit(spec=spec, idempotency_key=key):
                yield Ok(id=rid, result=await self._submit(spec, uid, key))
            case Resubmit(job_id=job_id, idempotency_key=key):
                job = await self._owned(job_id, uid, "resubmit")  # its spec carries the owner's environment
                if job.spec.task is None and job.spec.script is None:  # a stored spec that could not be read
                    raise RequestError(ErrorCode.NOT_RUNNABLE, f"job {job.id} has no spec to submit again")
                yield Ok(id=rid, result=await self._submit(job.spec, uid, key))
            case Status(job_id=job_id):
                job = await self._job(job_id)
                view = await with_rank_gpus(positioned(job.view(), self.scheduler.queue_positions()), job)
                yield Ok(id=rid, result=visible_view(view, await self._detail(uid)))
            case ListJobs(all=all_jobs, limit=limit, before=before):
                limit = min(limit, LIST_LIMIT)
                jobs = await self.scheduler.page(limit + 1, before, active=not all_jobs)
                yield Ok(id=rid, result=job_page(jobs, active_only=not all_jobs, limit=limit, before=before,
                                                 detail=await self._detail(uid),
                                                 positions=self.scheduler.queue_positions()))
            case Cancel(job_id=job_id, force=force):
                yield Ok(id=rid, result=await self._cancel(await self._owned(job_id, uid, "cancel"), uid, force))
            case Wait(job_id=job_id):
                job = await self._job(job_id)
                await job.finished.wait()
                yield Ok(id=rid, result=visible_view(job.view(), await self._detail(uid)))
            case Logs(job_id=job_id, rank=rank, ranks=ranks):
                job = await self._detailed(job_id, uid, "logs")
                for r in ([] if rank is None else [rank]) + (ranks or []):
                    if not 0 <= r < job.spec.nproc:
                        raise RequestError(ErrorCode.NOT_FOUND, f"job {job.id} has no rank {r}")
                async for chunk in log_chunks(self.scheduler.config.state_dir, job, req):
                    yield Item(id=rid, item=chunk)
                yield End(id=rid)
            case Events(job_id=job_id):
                events = (job_events(self.scheduler.journal, await self._detailed(job_id, uid, "events"), req)
                          if job_id else visible_events(self.scheduler, req, uid, await self._detail(uid)))
                async for event in events:
                    yield Item(id=rid, item=clip_event(event))
                yield End(id=rid)
            case Remove(job_id=job_id):
                job = await self._owned(job_id, uid, "remove")
                await self.scheduler.remove(job, uid)
                yield Ok(id=rid, result=None)
            case StacksReq(job_id=job_id, rank=rank, native=native):
                job = await self._detailed(job_id, uid, "stacks")
                attempt = self.scheduler.attempts.get(job.id)
                if attempt is None or job.state.final:
                    raise RequestError(ErrorCode.NOT_RUNNABLE, f"job {job.id} is {job.state.value}, not running")
                if rank is not None and not 0 <= rank < job.spec.nproc:
                    raise RequestError(ErrorCode.NOT_FOUND, f"job {job.id} has no rank {rank}")
                yield Ok(id=rid, result=await attempt.stacks(rank, native))
            case CurveReq(job_id=job_id):
                job = await self._detailed(job_id, uid, "curve")
                curve = None if self.curves is None else await self.curves.curve(job.id)
                yield Ok(id=rid, result=curve_result(job, curve))
            case Ping():
                yield Ok(id=rid, result="pong")
            case DaemonInfoReq():
                yield Ok(id=rid, result=await self._info_with_gpus())
            case Reload():
                if uid not in (0, os.getuid()):
                    raise RequestError(ErrorCode.PERMISSION_DENIED,
                                       f"only root or the daemon's user (uid {os.getuid()}) may reload it")
                await self.reload()
                yield Ok(id=rid, result=None)

    async def _submit(self, spec: JobSpec, uid: int, key: str | None) -> SubmitResult:
        if not self.scheduler.accepting:
            raise RequestError(ErrorCode.SHUTTING_DOWN, "the daemon is shutting down")
        spec = check_spec(spec)
        await self._check_submitter(spec, uid)
        job, existing = await self.scheduler.submit(spec, uid, idempotency_key=key)
        return SubmitResult(job_id=job.id, existing=existing)

    async def _cancel(self, job: Job, uid: int, force: bool) -> CancelResult:
        if job.state.final:
            raise RequestError(ErrorCode.NOT_RUNNABLE, f"job {job.id} already ended ({job.state.value})")
        if job.cancel_requested is not None and not force:
            return CancelResult(action="already_stopping", job=fit_view(job.view()))
        queued = job.state.value == "QUEUED"
        await self.scheduler.cancel(job, f"cancelled by uid {uid}", force)
        action = "cancelled" if queued else "killing" if force else "stopping"
        return CancelResult(action=action, job=fit_view(job.view()))
