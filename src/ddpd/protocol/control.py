"""Requests and replies on the control socket (ddpctl <-> ddpd); the shapes the replies carry are
in `protocol.views` and re-exported here.

Every field of a request is bounded by its type (ids and counters within int64 or tighter, strings
capped), so a decoded request is safe to act on; replies are built by the daemon and kept under the
frame limit by it (pages of `list`, clipped texts).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

import msgspec

from .logquery import MAX_TAIL
from .spec import INT64_MAX, INT64_MIN, MAX_NPROC, MAX_WORLD, JobSpec
from .views import (
    CancelResult,
    CurvePoint,
    CurveResult,
    DaemonInfo,
    EventView,
    GpuReleaseResult,
    GpuView,
    JobPage,
    JobView,
    LogChunk,
    PoolServerView,
    RankGpu,
    RankStacks,
    RankView,
    RemoveResult,
    RootCause,
    ShareResult,
    ShareView,
    StackGroup,
    StacksResult,
    SubmitResult,
    WhoAmI,
)

# the replies' shapes (protocol.views), re-exported: one surface for the control protocol
__all__ = [
    "CancelResult", "CurvePoint", "CurveResult", "DaemonInfo", "EventView", "GpuReleaseResult", "GpuView",
    "JobPage", "JobView", "LogChunk", "PoolServerView", "RankGpu", "RankStacks", "RankView", "RemoveResult",
    "RootCause", "ShareResult", "ShareView", "StackGroup", "StacksResult", "SubmitResult", "WhoAmI",
]

LIST_LIMIT = 500  # jobs in one page of `list` at most (a page also ends before the frame limit)
EVENTS_LIMIT = 100_000  # events one non-following `events` request may ask for

RequestId = Annotated[int, msgspec.Meta(ge=INT64_MIN, le=INT64_MAX)]
JobId = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
Seq = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]
GlobalRank = Annotated[int, msgspec.Meta(ge=0, lt=MAX_WORLD)]  # as `status` lists it (across nodes: torchrun's)
IdempotencyKey = Annotated[str, msgspec.Meta(min_length=1, max_length=128, pattern=r"^[\x21-\x7e]+$")]


class _Req(msgspec.Struct, tag_field="op", forbid_unknown_fields=True):
    id: RequestId


class HelloReq(_Req, tag="hello"):
    version: Annotated[int, msgspec.Meta(ge=0, le=2**31)]


class Submit(_Req, tag="submit"):
    spec: JobSpec
    # a retried submit with the same key (same owner) returns the job it created, never a second one
    idempotency_key: IdempotencyKey | None = None


class Resubmit(_Req, tag="resubmit"):
    """Submit the stored spec of a job again (its owner or root): a new job, a new id."""

    job_id: JobId
    idempotency_key: IdempotencyKey | None = None


class Status(_Req, tag="status"):
    job_id: JobId


class ListJobs(_Req, tag="list"):
    """One page of jobs, newest first: `before` (a job's seq) continues where JobPage.next left off."""

    all: bool = True  # False: only jobs not yet ended (queued, starting, running, restarting)
    limit: Annotated[int, msgspec.Meta(ge=1, le=INT64_MAX)] = 200  # the daemon serves at most LIST_LIMIT
    before: Seq | None = None


class Cancel(_Req, tag="cancel"):
    job_id: JobId
    force: bool = False


class Wait(_Req, tag="wait"):
    job_id: JobId


class Logs(_Req, tag="logs"):
    """A job's rank logs: `rank` or the rank set `ranks` (None: all of this daemon's), by global rank
    (another node's rank of a multi-node job: `other_node`), `stream` (stdout, stderr or both,
    ordered by stamp), the last `tail` lines of each rank and/or lines stamped at or after `since`
    (seconds since the epoch); see protocol.logquery and docs/logs.md."""

    job_id: JobId
    rank: GlobalRank | None = None
    attempt: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] | None = None
    follow: bool = False
    ranks: Annotated[list[GlobalRank],
                     msgspec.Meta(min_length=1, max_length=MAX_NPROC)] | None = None
    stream: Literal["stdout", "stderr", "both"] = "both"
    tail: Annotated[int, msgspec.Meta(ge=0, le=MAX_TAIL)] | None = None
    since: Annotated[float, msgspec.Meta(ge=0, le=1e11)] | None = None


class Events(_Req, tag="events"):
    """Events after seq `since`, oldest first: at most `limit` of them (None: all), then End; with
    `follow`, the stream goes on with live events (and ignores `limit`)."""

    job_id: JobId | None = None
    follow: bool = False
    since: Seq = 0
    limit: Annotated[int, msgspec.Meta(ge=1, le=EVENTS_LIMIT)] | None = None


class StacksReq(_Req, tag="stacks"):
    """The current stack of every thread of the job's live ranks on this daemon (or of `rank`, by
    global rank), the job running on; `native`: native frames too, with py-spy where the daemon
    has it."""

    job_id: JobId
    rank: GlobalRank | None = None
    native: bool = False


class Remove(_Req, tag="rm"):
    """Forget an ended job: its row, events, logs and checkpoints."""

    job_id: JobId


class Ping(_Req, tag="ping"):
    pass


class CurveReq(_Req, tag="curve"):
    """A job's training curve (step, loss, steps per second), as the daemon keeps it: downsampled,
    at most a few hundred points over the whole run (see CurveResult)."""

    job_id: JobId


class DaemonInfoReq(_Req, tag="daemon"):
    pass


class Reload(_Req, tag="reload"):
    pass


class WhoAmIReq(_Req, tag="whoami"):
    """Who the daemon takes the caller for: its uid (SO_PEERCRED), name, groups and rights (WhoAmI)."""


class GpuRelease(_Req, tag="gpu_release"):
    """Lift a GPU's quarantine (root and the admin group only): `gpu` is its NVML index (``3``,
    ``3/mig1``) or its UUID (or a unique prefix of it)."""

    gpu: Annotated[str, msgspec.Meta(min_length=1, max_length=96)]


class ShareReq(_Req, tag="share"):
    """Each user's recent usage and fair-share factor (ShareResult); anyone may ask, as Slurm's sshare."""


Request = (HelloReq | Submit | Status | ListJobs | Cancel | Wait | Logs | Events | Remove | Ping | DaemonInfoReq
           | Reload | StacksReq | CurveReq | Resubmit | WhoAmIReq | GpuRelease | ShareReq)
OPS: frozenset[str] = frozenset(str(kind.__struct_config__.tag) for kind in get_args(Request))
"""Every op a request may name: the tags of the `Request` union, so no op is known without its type."""


class RequestEnvelope(msgspec.Struct):
    """Only the id and op of a request: read first so a bad request still gets a reply with its id."""

    id: Any = None  # echoed in the reply only when it is an int64 (see `reply_id`)
    op: str | None = None


def reply_id(value: Any) -> int | None:
    """The id to echo in a reply: the request's, when it is an int64 (a bool is not)."""
    if isinstance(value, int) and not isinstance(value, bool) and INT64_MIN <= value <= INT64_MAX:
        return value
    return None


class _Rep(msgspec.Struct, tag_field="type", omit_defaults=True):
    id: int | None


class Ok(_Rep, tag="ok"):
    result: Any = None


class Item(_Rep, tag="item"):
    """One element of a follow-stream; the stream ends with End."""

    item: Any = None


class End(_Rep, tag="end"):
    pass


class Error(_Rep, tag="error"):
    code: str = "internal"
    message: str = ""


Reply = Ok | Item | End | Error
