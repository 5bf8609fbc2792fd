"""In-memory job and rank records (what the scheduler and the supervisor hold).

No storage here: the journal turns these records into rows and back.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple

import anyio

from ...protocol import JobSpec, JobState, RankState
from ...protocol.control import JobView, RankView, RootCause
from ...protocol.nodes import NodeView
from ...protocol.spec import dependency_ids
from .errors import ForbiddenError


@dataclass
class Rank:
    rank: int
    attempt: int
    state: RankState = RankState.SPAWNED
    pid: int | None = None
    pgid: int | None = None
    step: int = 0
    loss: float | None = None
    last_frame: float | None = None  # monotonic time of the last frame of any kind
    last_step_change: float | None = None
    spawned_at: float = field(default_factory=time.monotonic)
    exit_code: int | None = None
    signal: str | None = None
    checksum: float | None = None
    log: str | None = None
    stack_dump: bool = False
    replacements: int = 0  # times this rank was replaced in place during the attempt (hot replacement)

    def view(self, now: float) -> RankView:
        age = None if self.last_frame is None or self.state is RankState.EXITED else now - self.last_frame
        return RankView(
            rank=self.rank,
            attempt=self.attempt,
            state=self.state.value,
            pid=self.pid,
            pgid=self.pgid,
            step=self.step,
            loss=self.loss,
            heartbeat_age=None if age is None else round(age, 3),
            exit_code=self.exit_code,
            signal=self.signal,
            checksum=self.checksum,
            log=self.log,
            stack_dump=self.stack_dump,
            replacements=self.replacements,
        )


class LogCut(NamedTuple):
    """The last rotation of a live rank log: its count, and the bytes [start, end) of the live log
    that its ``.1`` now holds (see logindex: a follower goes on from there)."""

    generation: int
    start: int
    end: int


@dataclass
class Job:
    id: str
    seq: int
    name: str
    owner_uid: int
    spec: JobSpec
    state: JobState
    submitted_at: float
    attempt: int = 0
    started_at: float | None = None
    finished_at: float | None = None
    reason: str | None = None
    root_cause: RootCause | None = None
    ranks: list[Rank] = field(default_factory=list)
    store_port: int | None = None
    finished: anyio.Event = field(default_factory=anyio.Event)
    cancel_requested: str | None = None  # why, once asked
    gpus: list[str] = field(default_factory=list)  # each rank's devices, in rank order (gpu.layout)
    idempotency_key: str | None = None  # the submitter's key for retried submits (unique per owner)
    nodes: list[NodeView] = field(default_factory=list)  # a multi-node job's nodes, as this daemon knows them
    waiting_on: list[str] | None = None  # dependencies not yet ended, as last looked at (None: not yet)
    pending: str | None = None  # why a queued job has not started, as the scheduler last decided
    # each live rank log's last rotation, by path: set by the log keeper's thread just before the
    # live log is emptied (one dict item assignment), read by the daemon's log readers
    log_cuts: dict[str, LogCut] = field(default_factory=dict)
    hot_replaced: int = 0  # ranks replaced in place so far, all attempts (this daemon's run; not stored)

    def check_owner(self, uid: int, what: str) -> None:
        """ForbiddenError unless `uid` is the job's owner or root: who may `what` (cancel, remove...) it."""
        if uid not in (0, self.owner_uid):
            raise ForbiddenError(f"job {self.id} belongs to uid {self.owner_uid}; only it or root may {what} it")

    def view(self) -> JobView:
        now = time.monotonic()
        return JobView(
            id=self.id,
            name=self.name,
            state=self.state.value,
            owner_uid=self.owner_uid,
            submitted_at=self.submitted_at,
            spec=self.spec,
            attempt=self.attempt,
            started_at=self.started_at,
            finished_at=self.finished_at,
            reason=self.reason,
            root_cause=self.root_cause,
            ranks=[r.view(now) for r in self.ranks],
            store_port=self.store_port,
            nodes=list(self.nodes),
            waiting_on=(dependency_ids(self.spec) if self.waiting_on is None else self.waiting_on)
            if self.state is JobState.QUEUED and dependency_ids(self.spec) else None,
            pending=self.pending if self.state is JobState.QUEUED else None,
        )
