"""One function per request type, and `route`, the one `match` that picks it.

`route` ends in `assert_never`: a request type added to `protocol.control.Request` without its arm
here fails mypy, and the ops the server accepts are the union's tags (`protocol.control.OPS`). So
a request is added in three places: its type in the protocol, its handler here, its client call.

A handler returns its result (the server answers `Ok`) or is an async iterator of items (the
server sends each as `Item`, then `End`). Every expected failure is a `DaemonError` with its code
(`store.errors`); a spec or config error met here becomes one. Who may see a job's detail is
`visibility`'s; who may act on a job (its owner or root) is `Job.check_owner`.
"""

from __future__ import annotations

import functools
import os
import pwd
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, assert_never

import anyio
import anyio.to_thread
import msgspec

from ... import __version__
from ...protocol import PROTOCOL_VERSION, JobSpec, SpecError, check_spec
from ...protocol.control import (
    LIST_LIMIT,
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
    JobPage,
    JobView,
    ListJobs,
    LogChunk,
    Logs,
    Ping,
    Reload,
    Remove,
    RemoveResult,
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
from ...protocol.spec import reserved_env
from ..config import Config, ConfigError
from ..contain.cgroups import Subtree
from ..contain.identity import Identity, UnknownUser, check_serves, job_environment, submitted_environment
from ..gpu.gpuview import Devices, daemon_gpus, with_rank_gpus
from ..gpu.utilisation import UtilisationLog
from ..multinode.placement import check_rank, held_ranks
from ..queue.facade import Jobs, LiveConfig
from ..store.curves import CurveStore, curve_result
from ..store.errors import (
    BadConfigError,
    BadSpecError,
    ForbiddenError,
    NotRunnableError,
    ShuttingDownError,
    VersionMismatchError,
)
from ..store.journal import Journal
from ..store.records import Job
from .interpreters import InterpreterChecks
from .poolview import PoolServers
from .replies import Detail, clip_event, fit_view, job_page, positioned, visible_view
from .streams import job_events, log_chunks
from .visibility import detail_for, detail_rule, not_yours, viewer_of, visible_events

Answer = Awaitable[Any] | AsyncIterator[Any]
"""A handler's answer: its result, or the items of a stream."""


@dataclass(frozen=True)
class Services:
    """What control reads beside the jobs, built by `app`: the daemon's live config (read at each
    use: a reload replaces it), the journal (events, ranks), the devices and their recent utilisation
    (GPU views), the cgroup subtree (interpreter checks)."""

    live: LiveConfig
    journal: Journal
    devices: Devices
    utilization: UtilisationLog
    subtree: Subtree | None = None


@dataclass(frozen=True)
class Context:
    """What the handlers act on; built once by the control server."""

    jobs: Jobs  # the queue's facade (queue.facade.Jobs): its eight methods, nothing else of the queue
    services: Services
    info: Callable[[], DaemonInfo]
    reload: Callable[[], Awaitable[None]]
    curves: CurveStore | None
    interpreters: InterpreterChecks
    servers: PoolServers = field(default_factory=lambda: PoolServers(None))  # the pool's fork servers

    @property
    def config(self) -> Config:
        """The daemon's config now."""
        return self.services.live.current


def route(ctx: Context, req: Request, uid: int) -> Answer:
    """The handler of `req` for the peer `uid` (ForbiddenError where this daemon does not serve it)."""
    check_served(uid, ctx.config.allow_root_jobs)
    match req:
        case HelloReq():
            return hello(req)
        case Submit():
            return submit(ctx, req, uid)
        case Resubmit():
            return resubmit(ctx, req, uid)
        case Status():
            return status(ctx, req, uid)
        case ListJobs():
            return list_jobs(ctx, req, uid)
        case Cancel():
            return cancel(ctx, req, uid)
        case Wait():
            return wait(ctx, req, uid)
        case Logs():
            return logs(ctx, req, uid)
        case Events():
            return events(ctx, req, uid)
        case Remove():
            return remove(ctx, req, uid)
        case StacksReq():
            return stacks(ctx, req, uid)
        case CurveReq():
            return curve(ctx, req, uid)
        case Ping():
            return ping()
        case DaemonInfoReq():
            return daemon_info(ctx, uid)
        case Reload():
            return reload(ctx, uid)
        case WhoAmIReq():
            return whoami(ctx, uid)
        case GpuRelease():
            return gpu_release(ctx, req, uid)
        case ShareReq():
            return share(ctx)
        case _:
            assert_never(req)


def check_served(uid: int, allow_root_jobs: bool) -> None:
    """A per-user daemon serves its own uid only."""
    if os.geteuid() != 0 and uid != os.geteuid():
        raise ForbiddenError(check_serves(os.geteuid(), uid, allow_root_jobs) or "not served")


def may_reload(uid: int) -> bool:
    return uid in (0, os.getuid())


# -- the handlers, in the order of the protocol ------------------------------------------------


async def hello(req: HelloReq) -> dict[str, Any]:
    if req.version != PROTOCOL_VERSION:
        raise VersionMismatchError(f"client speaks protocol {req.version}, daemon {PROTOCOL_VERSION}")
    return {"version": PROTOCOL_VERSION, "daemon": __version__}


async def submit(ctx: Context, req: Submit, uid: int) -> SubmitResult:
    return await _submit(ctx, req.spec, uid, req.idempotency_key)


async def resubmit(ctx: Context, req: Resubmit, uid: int) -> SubmitResult:
    job = await _job(ctx, req.job_id)
    job.check_owner(uid, "resubmit")  # its spec carries the owner's environment
    if job.spec.task is None and job.spec.script is None:  # a stored spec that could not be read
        raise NotRunnableError(f"job {job.id} has no spec to submit again")
    submitted = await _submit(ctx, job.spec, uid, req.idempotency_key)
    return msgspec.structs.replace(submitted, of=job.id)


async def status(ctx: Context, req: Status, uid: int) -> JobView:
    job = await _job(ctx, req.job_id)
    view = await with_rank_gpus(positioned(job.view(), ctx.jobs.overview(order=True).positions), job,
                                ctx.services.devices, ctx.services.utilization)
    return visible_view(view, await _detail(ctx, uid))


async def list_jobs(ctx: Context, req: ListJobs, uid: int) -> JobPage:
    limit = min(req.limit, LIST_LIMIT)
    jobs = await ctx.jobs.page(limit + 1, req.before, active=not req.all)
    return job_page(jobs, active_only=not req.all, limit=limit, before=req.before,
                    detail=await _detail(ctx, uid), positions=ctx.jobs.overview(order=True).positions)


async def cancel(ctx: Context, req: Cancel, uid: int) -> CancelResult:
    job = await _job(ctx, req.job_id)
    job.check_owner(uid, "cancel")
    if job.state.final:
        raise NotRunnableError(f"job {job.id} already ended ({job.state.value})")
    if job.cancel_requested is not None and not req.force:
        return CancelResult(action="already_stopping", job=fit_view(job.view()))
    queued = job.state.value == "QUEUED"
    await ctx.jobs.cancel(job, f"cancelled by {await anyio.to_thread.run_sync(_user_label, uid)}", req.force)
    action = "cancelled" if queued else "killing" if req.force else "stopping"
    return CancelResult(action=action, job=fit_view(job.view()))


async def wait(ctx: Context, req: Wait, uid: int) -> JobView:
    job = await _job(ctx, req.job_id)
    await job.finished.wait()
    return visible_view(job.view(), await _detail(ctx, uid))


async def logs(ctx: Context, req: Logs, uid: int) -> AsyncIterator[LogChunk]:
    job = await _detailed(ctx, req.job_id, uid, "logs")
    held = functools.partial(held_ranks, ctx.services.journal, job)  # by global rank (multinode.placement)
    asked = ([] if req.rank is None else [req.rank]) + (req.ranks or [])
    if asked:
        mine = await held(req.attempt or job.attempt)
        for r in asked:
            check_rank(job, r, mine)
    async for chunk in log_chunks(ctx.config.state_dir, job, req, held):
        yield chunk


async def events(ctx: Context, req: Events, uid: int) -> AsyncIterator[EventView]:
    found = (job_events(ctx.services.journal, await _detailed(ctx, req.job_id, uid, "events"), req)
             if req.job_id else visible_events(ctx.jobs, ctx.services.journal, req, uid, await _detail(ctx, uid)))
    async for event in found:
        yield clip_event(event)


async def remove(ctx: Context, req: Remove, uid: int) -> RemoveResult:
    job = await _job(ctx, req.job_id)
    await ctx.jobs.remove(job, uid)  # the owner or root (Job.check_owner)
    return RemoveResult(job_id=job.id)


async def stacks(ctx: Context, req: StacksReq, uid: int) -> StacksResult:
    job = await _detailed(ctx, req.job_id, uid, "stacks")
    return await ctx.jobs.stacks(job, req.rank, req.native)  # not running, a rank it does not hold: refused


async def curve(ctx: Context, req: CurveReq, uid: int) -> CurveResult:
    job = await _detailed(ctx, req.job_id, uid, "curve")
    found = None if ctx.curves is None else await ctx.curves.curve(job.id)
    return curve_result(job, found)


async def ping() -> str:
    return "pong"


async def daemon_info(ctx: Context, uid: int) -> DaemonInfo:
    """The daemon's info with each GPU's memory, utilisation and holders (NVML; see gpuview), and the
    pool's fork servers (their keys and pids for those who may see their users' jobs' detail)."""
    info = ctx.info()
    servers = await ctx.servers.views(await _detail(ctx, uid))
    if servers:
        info = msgspec.structs.replace(info, pool_servers=servers)
    if info.gpus == 0:
        return info
    devices, note = await daemon_gpus(list(ctx.jobs.overview().running), ctx.services.devices)
    return msgspec.structs.replace(info, gpu_devices=devices, gpu_note=note)


async def reload(ctx: Context, uid: int) -> None:
    if not may_reload(uid):
        raise ForbiddenError(f"only root or the daemon's user (uid {os.getuid()}) may reload it")
    try:
        await ctx.reload()
    except ConfigError as exc:
        raise BadConfigError(str(exc)) from None


async def whoami(ctx: Context, uid: int) -> WhoAmI:
    """The caller as this daemon sees it: passwd and group databases, the config's admin group."""
    cfg = ctx.config
    viewer, admin = await anyio.to_thread.run_sync(viewer_of, uid, cfg.admin_group)
    groups = [] if viewer is None else await anyio.to_thread.run_sync(viewer.group_names)
    return WhoAmI(uid=uid, name=None if viewer is None else viewer.name, groups=groups, admin_group=cfg.admin_group,
                  detail_of_all=detail_rule(uid, viewer, admin)(-1),  # -1: no one's uid, so anyone's job
                  may_reload=may_reload(uid), submit_refusal=check_serves(os.geteuid(), uid, cfg.allow_root_jobs))


async def gpu_release(ctx: Context, req: GpuRelease, uid: int) -> GpuReleaseResult:
    """Lift a GPU's quarantine (queue.gpuhealth): root, the daemon's user and the admin group only."""
    if not (may_reload(uid) or (await _detail(ctx, uid))(-1)):  # -1: anyone's: an admin
        raise ForbiddenError("only root and the admin group may release a quarantined GPU")
    record = await ctx.jobs.release_gpu(req.gpu, uid)
    return GpuReleaseResult(gpu=record.label, reason=record.reason, since=record.at)


async def share(ctx: Context) -> ShareResult:
    """Each user's usage and fair-share factor (queue.fairshare), with their names where passwd has them."""
    overview = ctx.jobs.overview(order=True)
    views, half_life = overview.shares, overview.half_life
    names = await anyio.to_thread.run_sync(lambda: {v.uid: _user_name(v.uid) for v in views})
    return ShareResult(users=[msgspec.structs.replace(v, name=names[v.uid]) for v in views], half_life=half_life)


def _user_name(uid: int) -> str | None:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return None


# -- shared steps ----------------------------------------------------------------------------


async def _job(ctx: Context, job_id: str) -> Job:
    """The job a request names: its id or a unique prefix (not_found, ambiguous: see jobids)."""
    return await ctx.jobs.find(job_id)


async def _detail(ctx: Context, uid: int) -> Detail:
    return await detail_for(uid, ctx.config.admin_group)


async def _detailed(ctx: Context, job_id: str, uid: int, what: str) -> Job:
    """The job, if `uid` may see its detail (`what`: its logs, its events); else ForbiddenError."""
    job = await _job(ctx, job_id)
    if not (await _detail(ctx, uid))(job.owner_uid):
        raise ForbiddenError(not_yours(job, what))
    return job


async def _submit(ctx: Context, spec: JobSpec, uid: int, key: str | None) -> SubmitResult:
    if not ctx.jobs.overview().accepting:
        raise ShuttingDownError("the daemon is shutting down")
    try:
        spec = check_spec(spec)
        await _check_submitter(ctx, spec, uid)
        done = await ctx.jobs.submit(spec, uid, idempotency_key=key)
    except SpecError as exc:
        raise BadSpecError(str(exc)) from None
    return SubmitResult(job_id=done.job.id, existing=done.existing, notices=done.notices)


async def _check_submitter(ctx: Context, spec: JobSpec, uid: int) -> None:
    """Who may submit (check_serves) and whether the job's interpreter runs for them (SpecError `python`)."""
    cfg = ctx.config
    refusal = check_serves(os.geteuid(), uid, cfg.allow_root_jobs)
    if refusal is not None:
        raise ForbiddenError(refusal)
    python = spec.python
    if python is None and os.geteuid() == 0 and uid != 0 and not cfg.worker_command:
        python = sys.executable  # a spec naming no interpreter, of another user: the daemon's, run as that user
    if python is None:
        return  # a spec naming no interpreter, of the daemon's own user: the daemon's interpreter
    identity = await _identity(uid)
    exported = {k: v for k, v in submitted_environment(identity, spec.environ).items() if not reserved_env(k)}
    env = job_environment(identity, exported, spec.env, {})
    reason = await ctx.interpreters.refusal(identity, python, env, cfg.interpreter_check_timeout)
    if reason is not None:
        raise SpecError("python", reason)


async def _identity(uid: int) -> Identity:
    try:
        return await anyio.to_thread.run_sync(Identity.of, uid)
    except UnknownUser as exc:
        raise ForbiddenError(str(exc)) from None


def _user_label(uid: int) -> str:
    """`alice (uid 1000)`, or `uid 1000` where the user has no passwd entry (blocking: NSS)."""
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"
