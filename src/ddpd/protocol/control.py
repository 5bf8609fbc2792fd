"""Requests and replies on the control socket (ddpctl <-> ddpd)."""

from __future__ import annotations

from typing import Any

import msgspec

from .spec import JobSpec


class _Req(msgspec.Struct, tag_field="op", forbid_unknown_fields=True):
    id: int


class HelloReq(_Req, tag="hello"):
    version: int


class Submit(_Req, tag="submit"):
    spec: JobSpec
    # a retried submit with the same key (same owner) returns the job it created, never a second one
    idempotency_key: str | None = None


class Status(_Req, tag="status"):
    job_id: str


class ListJobs(_Req, tag="list"):
    """One page of jobs, newest first: `before` (a job's seq) continues where JobPage.next left off."""

    all: bool = True  # False: only jobs not yet ended (queued, starting, running, restarting)
    limit: int = 200
    before: int | None = None


class Cancel(_Req, tag="cancel"):
    job_id: str
    force: bool = False


class Wait(_Req, tag="wait"):
    job_id: str


class Logs(_Req, tag="logs"):
    job_id: str
    rank: int | None = None
    attempt: int | None = None
    follow: bool = False


class Events(_Req, tag="events"):
    job_id: str | None = None
    follow: bool = False
    since: int = 0


class Remove(_Req, tag="rm"):
    """Forget an ended job: its row, events, logs and checkpoints."""

    job_id: str


class Ping(_Req, tag="ping"):
    pass


class DaemonInfoReq(_Req, tag="daemon"):
    pass


class Reload(_Req, tag="reload"):
    pass


Request = (HelloReq | Submit | Status | ListJobs | Cancel | Wait | Logs | Events | Remove | Ping | DaemonInfoReq
           | Reload)


class RequestEnvelope(msgspec.Struct):
    """Only the id and op of a request: read first so a bad request still gets a reply with its id."""

    id: int | None = None
    op: str | None = None


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


# Result shapes


class RootCause(msgspec.Struct, omit_defaults=True):
    reason: str
    rank: int | None = None
    attempt: int | None = None
    exit_code: int | None = None
    signal: str | None = None
    phase: str | None = None
    error: str | None = None
    message: str | None = None
    traceback: str | None = None
    ranks: list[int] | None = None
    detail: str | None = None


class RankView(msgspec.Struct, omit_defaults=False):
    rank: int
    attempt: int
    state: str
    pid: int | None = None
    pgid: int | None = None
    step: int = 0
    loss: float | None = None
    heartbeat_age: float | None = None
    exit_code: int | None = None
    signal: str | None = None
    checksum: float | None = None
    log: str | None = None
    stack_dump: bool = False


class JobView(msgspec.Struct, omit_defaults=False):
    id: str
    name: str
    state: str
    owner_uid: int
    submitted_at: float
    spec: JobSpec
    attempt: int = 0
    started_at: float | None = None
    finished_at: float | None = None
    reason: str | None = None
    root_cause: RootCause | None = None
    ranks: list[RankView] = msgspec.field(default_factory=list)
    store_port: int | None = None


class EventView(msgspec.Struct, omit_defaults=True):
    seq: int
    ts: float
    kind: str
    job_id: str | None = None
    attempt: int | None = None
    rank: int | None = None
    data: dict[str, Any] = msgspec.field(default_factory=dict)


class LogChunk(msgspec.Struct):
    rank: int
    attempt: int
    text: str


class SubmitResult(msgspec.Struct):
    job_id: str
    existing: bool = False  # True: the idempotency key matched a job submitted before


class JobPage(msgspec.Struct):
    """A page of `list`: `next` is the `before` of the following page, None on the last."""

    jobs: list[JobView]
    next: int | None = None


class CancelResult(msgspec.Struct):
    """What a cancel did: `action` is "cancelled" (a queued job, now CANCELLED), "stopping" (ranks asked
    to stop at a step boundary, then torn down) or "killing" (force: SIGKILL now)."""

    action: str
    job: JobView


class DaemonInfo(msgspec.Struct):
    version: str
    protocol: int
    pid: int
    uptime: float
    socket: str
    state_dir: str
    running: int
    queued: int
    cpu_slots: int
    gpus: int
    free_cpu_slots: int | None = None
    free_gpus: int | None = None
    pool_ready: int | None = None
