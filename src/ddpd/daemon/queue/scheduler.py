"""The queue: admission, and placement by `decide.plan` (who starts, who waits, whom to preempt).

A submission is checked (`admission`), then saved before it is published: one whose row cannot be
written raises StorageError and leaves no trace. At each wake the scheduler reads the queue (a job
whose dependency failed fails now; one still waiting lets those behind it start) and applies the
plan: a job that may start gets its resources and a `JobRunner` (queue.runner) that supervises it
until it ends or goes back to the queue; a victim is sent `Preempt`. When a runner returns, the job's
resources go back (a GPU job's once nothing of it can hold its GPUs: `gpu.drain`).
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread
import structlog

from ...protocol import JobSpec, JobState, SpecError
from ...protocol.control import RootCause
from ...protocol.spec import dependency_ids, is_multinode
from ..config import Config
from ..contain.portfence import FenceError, daemon_tag
from ..contain.portfence import require as require_fences
from ..gpu.drain import drain_job
from ..multinode.elastic import NodeError, check_endpoint
from ..store.records import Job
from . import decide
from .admission import PathChecks, admit, check_key, check_limits, check_priority
from .commands import Cancel, Preempt, Stop
from .dependencies import Broken, Ready, kinds_of, resolve_after, states_of, verdict
from .ends import JobEnds
from .fairshare import FairShare
from .history import History
from .resources import Resources
from .runner import JobRunner, Supervision
from .runners import Runners
from .table import JobTable

log = structlog.get_logger("ddpd")


@dataclass(frozen=True)
class Submitted:
    """A submit's outcome: the job, whether its owner's key named it before, and notices for the submitter."""

    job: Job
    existing: bool = False
    notices: list[str] = field(default_factory=list)


class Scheduler:
    def __init__(self, sup: Supervision, resources: Resources, table: JobTable, runners: Runners, share: FairShare,
                 history: History, clock: Callable[[], float] = time.time) -> None:
        self.sup = sup  # the runners' (its config is the daemon's current one)
        self.journal = sup.journal
        self.ends: JobEnds = sup.ends
        self.resources = resources
        self.table = table
        self.runners = runners
        self.share = share
        self.history = history
        self.clock = clock  # wall-clock time (fair share and retention are counted in it)
        self.accepting = True  # False once the daemon stops: nothing more starts
        self.since: dict[str, float] = {}  # running job id -> when its resources were taken (wall clock)
        self.preempting: dict[str, tuple[int, str]] = {}  # job id -> (its attempt asked to stop, for which job)
        self.paths = PathChecks()  # a submit's paths, looked at as its submitter
        self._wake = anyio.Event()
        self._pending_keys: dict[tuple[int, str], anyio.Event] = {}

    @property
    def config(self) -> Config:
        return self.sup.config

    def wake(self) -> None:
        """Something changed that may let a queued job start (or fail, or wait for another reason)."""
        self._wake.set()

    def queue_positions(self) -> dict[str, int]:
        """Each queued job's place in line (1: the next to start), in the order the scheduler admits them."""
        waiting = [j for j in self.table.queued() if j.id not in self.runners]
        return {j.id: n for n, j in enumerate(decide.order(waiting, self.fair_factors()), start=1)}

    def fair_factors(self, also: frozenset[int] = frozenset()) -> dict[int, float]:
        """Each user's fair-share factor now: of the users with jobs queued or running (those that share
        the box), and of `also`."""
        now = self.clock()
        self.share.charge(self.runners.running_jobs(), now)  # what the running jobs used so far counts (saved later)
        usage = {uid: u.total for uid, u in self.share.now(now).items()}
        return decide.factors(usage, {j.owner_uid for j in self.table.unended.values()} | also)

    # -- admission -------------------------------------------------------------------------

    async def submit(self, spec: JobSpec, owner_uid: int, idempotency_key: str | None = None) -> Submitted:
        """Check, save, then publish a job; `existing` when the owner's key names a job submitted before,
        with what the submitter should be told (its history at its bounds)."""
        key = None if idempotency_key is None else (owner_uid, check_key(idempotency_key))
        if key is not None and (existing := await self.table.by_key(*key)) is not None:
            return Submitted(existing, True)
        spec = await admit(spec, self.config, self.resources)
        await check_priority(spec, self.config, owner_uid)
        await self.paths.check(spec, owner_uid)
        spec = await resolve_after(spec, self.table)
        try:
            await anyio.to_thread.run_sync(check_endpoint, spec, owner_uid)  # free, where this daemon serves it
            if is_multinode(spec) and not self.config.allow_unfenced:  # its ports fenced, or no such job (portfence)
                await anyio.to_thread.run_sync(require_fences, daemon_tag(self.config.state_dir))
        except (NodeError, FenceError) as exc:
            raise SpecError("rdzv_endpoint", str(exc).removeprefix("rdzv_endpoint: ")) from None
        notices = await self.history.notices(owner_uid, spec)
        while key is not None and (pending := self._pending_keys.get(key)) is not None:
            await pending.wait()  # the same key is being saved: its outcome decides
        done = anyio.Event()
        if key is not None:
            self._pending_keys[key] = done  # from here until saved, a submit with this key waits
        try:
            if key is not None and (existing := await self.table.by_key(*key)) is not None:
                return Submitted(existing, True)
            job = await self._save(spec, owner_uid, idempotency_key)
        finally:
            if key is not None:
                del self._pending_keys[key]
            done.set()
        # never an environment value in the journal: the interpreter and what --export named at most
        shape: dict[str, Any] = {"python": spec.python, "export": spec.export} if spec.python else {}
        await self.journal.event(job, "job.submitted", owner_uid=owner_uid, nproc=spec.nproc,
                                 task=spec.task, script=spec.script, **shape)
        self.wake()
        return Submitted(job, False, notices)

    async def _save(self, spec: JobSpec, owner_uid: int, idempotency_key: str | None) -> Job:
        check_limits(self.config, self.table.unended.values(), owner_uid)
        seq = self.table.next_seq()
        job = Job(
            id=f"j{seq}-{secrets.token_hex(2)}",
            seq=seq,
            name=spec.name or (spec.task or os.path.basename(spec.script[0] if spec.script else "job")),
            owner_uid=owner_uid,
            spec=spec,
            state=JobState.QUEUED,
            submitted_at=self.clock(),
            idempotency_key=idempotency_key,
        )
        await self.journal.create_job(job)  # StorageError: nothing published
        self.table.add(job)
        return job

    async def cancel(self, job: Job, reason: str, force: bool) -> None:
        """A queued job is CANCELLED here; a started one is told by its runner (returns once it was)."""
        if job.state.final:
            return
        if job.state is JobState.QUEUED:
            job.cancel_requested = reason
            await self.journal.job_state(job, JobState.CANCELLED, reason, finish=False)
            await self.ends.ended(job)
            self.wake()
            return
        await self.runners.send(job.id, Cancel(reason, force)).wait()

    # -- the scheduling loop ---------------------------------------------------------------

    async def run(self) -> None:
        """Place the queue at every wake, until cancelled; each started job's task runs in here."""
        async with anyio.create_task_group() as tg:
            while True:
                await self._wake.wait()
                self._wake = anyio.Event()
                if not self.accepting:
                    continue
                queue = [job for job in self.table.queued() if job.id not in self.runners]  # not those started
                # a job waiting for its dependencies lets the jobs behind it start; one whose dependency
                # failed fails now, whatever the queue is waiting for
                blocked = {j.id for j in queue if dependency_ids(j.spec) and not await self._dependencies_met(j)}
                if self.accepting:  # (the daemon may have begun to stop while they were read: its Stop went out)
                    self._admit(tg, queue, blocked)

    def _admit(self, tg: anyio.abc.TaskGroup, queue: list[Job], blocked: set[str]) -> None:
        """Apply `decide.plan` (priority, fair share, submission; the head is never overtaken): start the
        jobs that may start now, preempt for the one that may, and give every other one its pending reason
        (`Job.pending`)."""
        now = self.clock()
        running_jobs = self.runners.running_jobs()
        self.share.charge(running_jobs, now)
        if users := self.share.due(now):  # saved now and then, not at every wake
            tg.start_soon(self.share.save, users)
        usage = {uid: u.total for uid, u in self.share.now(now).items()}
        running = [decide.Running(j, self.since.get(j.id, now)) for j in running_jobs]
        queue = [j for j in queue if j.state is JobState.QUEUED]  # (not cancelled while deps were read)
        for decision in decide.plan(queue, blocked, running, usage, now, self.resources, self.config,
                                    self._being_preempted()):
            match decision:
                case decide.Start(job=job):
                    self._start(tg, job, now)
                case decide.Wait(job=job, reason=reason):
                    job.pending = reason
                case decide.Preempt(job=job, victims=victims, reason=reason):
                    job.pending = reason
                    for victim in victims:
                        self._preempt(victim, job)

    def _being_preempted(self) -> set[str]:
        """The running jobs whose current attempt was asked to stop for another (asked again: never)."""
        return {jid for jid, (n, _) in self.preempting.items() if (j := self.table.jobs.get(jid)) and j.attempt == n}

    def _start(self, tg: anyio.abc.TaskGroup, job: Job, now: float) -> None:
        gpus = self.resources.take(job.spec)
        if gpus is None:  # (the plan took from a copy of the same resources: never)
            job.pending = f"resources: {self.resources.shortfall(job.spec)}"
            return
        job.pending = None
        job.gpus = gpus
        runner = JobRunner(job, self.sup)
        self.runners.add(runner)
        self.since[job.id] = now
        self.share.start(job, now)
        tg.start_soon(self._run_job, runner)

    def _preempt(self, victim: Job, by: Job) -> None:
        """Stop `victim` at an agreed step, checkpointed, and requeue it (`AttemptEnd.PREEMPTED`)."""
        self.preempting[victim.id] = (victim.attempt, by.id)
        self.runners.send(victim.id, Preempt(victim.attempt, by.id, by.owner_uid, by.spec.priority))

    async def _run_job(self, runner: JobRunner) -> None:
        """The job's runner, then its resources back (a GPU job's once drained)."""
        job = runner.job
        try:
            end = await runner.run()
            log.debug("job.runner_ended", job_id=job.id, end=type(end).__name__)
        finally:
            users = self.share.stop(job, self.clock())
            self.since.pop(job.id, None)
            self.preempting.pop(job.id, None)
            gpus, job.gpus = job.gpus, []
            if gpus:
                self.resources.hold(job.id, gpus)
            else:
                self.resources.give_back(job.spec, gpus)
            self.runners.remove(job.id)
            if self.sup.pool is not None:
                self.sup.pool.poke()
            self.wake()
        if users:
            await self.share.save(users)
        if gpus:
            await self._drain(job, gpus)

    async def _drain(self, job: Job, gpus: list[str]) -> None:
        try:
            await drain_job(job, [d for e in dict.fromkeys(gpus) if (d := self.resources.device(e))], self.journal)
        finally:
            self.resources.give_back(job.spec, gpus, job.id)
            self.wake()

    async def _dependencies_met(self, job: Job) -> bool:
        """Whether every job `job` waits for has SUCCEEDED; fails it when one ended otherwise."""
        pending = dependency_ids(job.spec) if job.waiting_on is None else job.waiting_on
        try:
            states = await states_of(pending, self.table.lookup)
        except Exception:  # the journal cannot be read now: the job waits, the queue goes on
            log.exception("job.dependencies_unreadable", job_id=job.id)
            return False
        if job.state is not JobState.QUEUED:  # cancelled while they were read
            return False
        match verdict(states, kinds_of(job.spec)):
            case Ready():
                job.waiting_on = []
                return True
            case Broken(reason=reason):
                job.root_cause = RootCause(reason=reason)
                await self.journal.job_state(job, JobState.FAILED, reason, finish=False, root_cause=reason)
                await self.ends.ended(job)
                self.wake()  # the jobs that wait for this one fail in turn
            case waiting:
                job.waiting_on = waiting.on
        return False

    # -- shutdown --------------------------------------------------------------------------

    async def shutdown(self, force: bool) -> None:
        """Stop taking work; running jobs stop gracefully (or are killed at once) and go back to the queue."""
        self.accepting = False
        await self.runners.tell_all(Stop(force))
        await self.runners.idle()
        await self.share.save(list(self.share.usage))  # what the last jobs used, before the loop is cancelled
