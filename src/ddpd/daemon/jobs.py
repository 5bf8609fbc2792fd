"""In-memory job and rank records, and the journal: every state change is one SQLite write,
one event for followers, and one structured log line."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import msgspec
import structlog
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ..protocol import JobSpec, JobState, RankState, check_job_transition, check_rank_transition
from ..protocol.control import EventView, JobView, RankView, RootCause
from .state import StateDB

log = structlog.get_logger("ddpd")


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
        )

    def row(self, job_id: str) -> dict[str, Any]:
        return {
            "job_id": job_id,
            "attempt": self.attempt,
            "rank": self.rank,
            "state": self.state.value,
            "pid": self.pid,
            "pgid": self.pgid,
            "step": self.step,
            "loss": self.loss,
            "exit_code": self.exit_code,
            "signal": self.signal,
            "checksum": self.checksum,
            "log": self.log,
            "stack_dump": int(self.stack_dump),
        }


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
    gpus: list[int] = field(default_factory=list)

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
        )

    def row(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "seq": self.seq,
            "name": self.name,
            "owner_uid": self.owner_uid,
            "spec": msgspec.json.encode(self.spec).decode(),
            "state": self.state.value,
            "attempt": self.attempt,
            "priority": self.spec.priority,
            "submitted_at": self.submitted_at,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "reason": self.reason,
            "root_cause": None if self.root_cause is None else msgspec.json.encode(self.root_cause).decode(),
        }


class EventBus:
    """Fan-out of events to followers; a follower too slow to keep up is dropped, never waited on."""

    def __init__(self, buffer: int = 10_000) -> None:
        self._subs: set[MemoryObjectSendStream[EventView]] = set()
        self._buffer = buffer

    def subscribe(self) -> MemoryObjectReceiveStream[EventView]:
        send, recv = anyio.create_memory_object_stream[EventView](self._buffer)
        self._subs.add(send)
        return recv

    def publish(self, event: EventView) -> None:
        for send in list(self._subs):
            try:
                send.send_nowait(event)
            except (anyio.WouldBlock, anyio.BrokenResourceError, anyio.ClosedResourceError):
                self._subs.discard(send)
                send.close()


class Journal:
    """The one place job and rank state changes happen."""

    def __init__(self, db: StateDB, bus: EventBus) -> None:
        self.db = db
        self.bus = bus

    async def event(
        self, job: Job | None, kind: str, *, rank: int | None = None, persist: bool = True, **data: Any
    ) -> None:
        ts = time.time()
        job_id = job.id if job else None
        attempt = job.attempt if job else None
        seq = await self.db.add_event(ts, job_id, attempt, rank, kind, data) if persist else 0
        self.bus.publish(EventView(seq=seq, ts=ts, kind=kind, job_id=job_id, attempt=attempt, rank=rank, data=data))
        if persist:
            level = "warning" if kind in _WARN_EVENTS else "info"
            fields = dict(data)
            if isinstance(fields.get("traceback"), str):  # its tail: where it failed, bounded for journald
                fields["traceback"] = fields["traceback"][-LOG_TRACEBACK_CHARS:]
            getattr(log, level)(kind, job_id=job_id, attempt=attempt, rank=rank, **fields)

    async def save_job(self, job: Job) -> None:
        await self.db.upsert("jobs", ("id",), job.row())

    async def save_attempt(self, job: Job, attempt: int, *, pgid: int | None, store_port: int | None,
                           token: str) -> None:
        await self.db.upsert("attempts", ("job_id", "attempt"),
                             {"job_id": job.id, "attempt": attempt, "pgid": pgid, "store_port": store_port,
                              "token": token, "started_at": time.time()})

    async def save_rank(self, job: Job, rank: Rank) -> None:
        await self.db.upsert("ranks", ("job_id", "attempt", "rank"), rank.row(job.id))

    async def job_state(self, job: Job, new: JobState, reason: str | None = None, **data: Any) -> None:
        old = job.state
        check_job_transition(old, new)
        job.state = new
        now = time.time()
        if new is JobState.STARTING and job.started_at is None:
            job.started_at = now
        if reason is not None:
            job.reason = reason
        if new.final:
            job.finished_at = now
        await self.save_job(job)
        data.update({"from": old.value, "to": new.value, "reason": reason})
        await self.event(job, "job.state_changed", **data)
        if new.final:
            job.finished.set()

    async def rank_state(
        self, job: Job, rank: Rank, new: RankState, kind: str = "rank.state_changed", **data: Any
    ) -> None:
        old = rank.state
        check_rank_transition(old, new)
        rank.state = new
        await self.save_rank(job, rank)
        data.update({"from": old.value, "to": new.value})
        await self.event(job, kind, rank=rank.rank, **data)


LOG_TRACEBACK_CHARS = 4000
_WARN_EVENTS = frozenset({"rank.heartbeat_missed", "job.teardown", "rank.failed", "job.leftover_killed",
                          "rank.unkillable", "rank.protocol_error"})


def root_cause_from_json(raw: str | None) -> RootCause | None:
    return None if raw is None else msgspec.json.decode(raw, type=RootCause)


def job_from_row(row: Any) -> Job:
    return Job(
        id=row["id"],
        seq=row["seq"],
        name=row["name"],
        owner_uid=row["owner_uid"],
        spec=msgspec.json.decode(row["spec"], type=JobSpec),
        state=JobState(row["state"]),
        submitted_at=row["submitted_at"],
        attempt=row["attempt"],
        started_at=row["started_at"],
        finished_at=row["finished_at"],
        reason=row["reason"],
        root_cause=root_cause_from_json(row["root_cause"]),
    )


def rank_from_row(row: Any) -> Rank:
    return Rank(
        rank=row["rank"],
        attempt=row["attempt"],
        state=RankState(row["state"]),
        pid=row["pid"],
        pgid=row["pgid"],
        step=row["step"],
        loss=row["loss"],
        exit_code=row["exit_code"],
        signal=row["signal"],
        checksum=row["checksum"],
        log=row["log"],
        stack_dump=bool(row["stack_dump"]),
    )


def job_dir(state_dir: Path, job_id: str) -> Path:
    return state_dir / "jobs" / job_id


def attempt_dir(state_dir: Path, job_id: str, attempt: int) -> Path:
    return job_dir(state_dir, job_id) / f"attempt-{attempt}"


def rank_log(state_dir: Path, job_id: str, attempt: int, rank: int) -> Path:
    """Where a rank's stdout and stderr go (the supervisor writes it, `logs` reads it)."""
    return attempt_dir(state_dir, job_id, attempt) / f"rank-{rank}.log"
