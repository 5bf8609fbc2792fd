"""The durable queue: admission, one runner task per job, restarts, recovery, retention and removal.

Decisions on job states come from `lifecycle`; every write goes through the journal. A job is saved
before it is published: a submission whose row cannot be written raises StorageError and leaves no trace.
"""

from __future__ import annotations

import functools
import os
import secrets
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread
import msgspec
import structlog

from ...protocol import JobSpec, JobState, SpecError
from ...protocol.control import RootCause
from ...protocol.spec import dependency_ids, is_multinode
from ...protocol.worker import marker_entry
from ..attempt.attempt import Attempt, Outcome
from ..config import Config, JobTimeouts
from ..contain.cgroups import Subtree
from ..contain.portfence import FenceError, daemon_tag
from ..contain.portfence import require as require_fences
from ..contain.usertree import remove_job_dir
from ..gpu.drain import drain_job
from ..layout import job_dir
from ..multinode.elastic import NodeError, check_endpoint
from ..multinode.nodes import NodeSession
from ..pool.pool import WarmPool
from ..run import lifecycle
from ..run.outcome import AttemptEnd
from ..store.errors import NotRunnableError
from ..store.journal import Journal
from ..store.records import Job
from . import decide
from .admission import PathChecks, admit, check_key, check_limits, check_priority
from .dependencies import Broken, Ready, kinds_of, resolve_after, states_of, verdict
from .fairshare import FairShare
from .gpuhealth import GpuHealth
from .leftovers import kill_cgroup, kill_marked
from .notifyhooks import Notifier
from .resources import Resources
from .retention import Retention, beyond_bounds, past_bounds
from .table import JobTable

log = structlog.get_logger("ddpd")

MIB = 1024 * 1024
RETIRED_NAMED = 10  # retired jobs named in a submit's notice (the rest counted)
RETIRE_BATCH = 200  # one user's jobs retired per look (a submit waits for at most these)


@dataclass(frozen=True)
class Submitted:
    """A submit's outcome: the job, whether its owner's key named it before, and notices for the submitter."""

    job: Job
    existing: bool = False
    notices: list[str] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: Config, journal: Journal, resources: Resources, pool: WarmPool | None = None,
                 clock: Callable[[], float] = time.time, subtree: Subtree | None = None) -> None:
        self.config = config
        self.pool = pool
        self.subtree = subtree  # where attempts get their cgroups; None: process groups and markers only
        self.journal = journal
        self.resources = resources
        self.clock = clock  # wall-clock time (retention is counted in it)
        self.table = JobTable(journal)
        self.jobs = self.table.jobs  # every unended job and the most recent ended ones (see table)
        self.unended = self.table.unended
        self.attempts: dict[str, Attempt] = {}
        self.running: set[str] = set()
        self._wake = anyio.Event()
        self.accepting = True
        self._idle = anyio.Event()
        self._pending_keys: dict[tuple[int, str], anyio.Event] = {}
        self.retention = Retention(journal, config.retention, clock)
        self._tg: anyio.abc.TaskGroup | None = None  # run's: where draining GPUs are waited for
        self.health = GpuHealth(journal, resources, self.attempts, self.running_jobs, self._notify,
                                lambda: self.config, lambda job, why: self.cancel(job, why, force=False))
        self.share = FairShare(journal, config.fairshare_half_life)  # each user's recent usage (queue.fairshare)
        self.since: dict[str, float] = {}  # running job id -> when its resources were taken (wall clock)
        self.preempting: dict[str, str] = {}  # running job id being preempted -> the job it makes room for
        self.notifier = Notifier(lambda: self.config, journal, subtree)  # each job's hooks, as its submitter
        self.paths = PathChecks()  # a submit's paths, looked at as its submitter
        self._retiring = anyio.Lock()  # one user's history retired at a time (by the retention task or a submit)

    # -- queries ---------------------------------------------------------------------------

    def counts(self) -> tuple[int, int]:
        queued = sum(1 for j in self.unended.values() if j.state is JobState.QUEUED)
        return len(self.running), queued

    def running_jobs(self) -> list[Job]:
        """The jobs started by this scheduler and not yet ended (they hold their resources)."""
        return [j for j in self.unended.values() if j.id in self.running]

    async def lookup(self, job_id: str) -> Job | None:
        """A job by id, held in memory or read from the journal (None: no such job)."""
        return await self.table.lookup(job_id)

    async def page(self, limit: int, before: int | None = None, *, owner_uid: int | None = None,
                   active: bool = False) -> list[Job]:
        """Up to `limit` jobs with seq below `before`, newest first."""
        return await self.table.page(limit, before, owner_uid=owner_uid, active=active)

    def queue_positions(self) -> dict[str, int]:
        """Each queued job's place in line (1: the next to start), in the order the scheduler admits them."""
        waiting = [j for j in self.table.queued() if j.id not in self.running]
        return {j.id: n for n, j in enumerate(decide.order(waiting, self.fair_factors()), start=1)}

    def fair_factors(self, also: frozenset[int] = frozenset()) -> dict[int, float]:
        """Each user's fair-share factor now: of the users with jobs queued or running (those that share
        the box), and of `also`."""
        now = self.clock()
        self.share.charge(self.running_jobs(), now)  # what the running jobs used so far counts (saved later)
        usage = {uid: u.total for uid, u in self.share.now(now).items()}
        return decide.factors(usage, {j.owner_uid for j in self.unended.values()} | also)

    def state_counts(self) -> dict[JobState, int]:
        return self.table.state_counts()

    def timeouts(self, spec: JobSpec) -> JobTimeouts:
        return self.config.defaults.resolve(spec.timeouts)

    def reconfigure(self, config: Config) -> None:
        """A reloaded config: limits and defaults for new attempts, CPU slots, retention."""
        self.resources.resize_cpu(config.cpu_slots)
        self.config = config
        self.retention.reconfigure(config.retention)
        self._notify()  # a raised limit may let queued jobs start

    # -- admission -------------------------------------------------------------------------

    async def submit(self, spec: JobSpec, owner_uid: int, idempotency_key: str | None = None) -> tuple[Job, bool]:
        """Check, save, then publish a job; (job, True) when the owner's key names a job submitted before."""
        done = await self.submit_noting(spec, owner_uid, idempotency_key)
        return done.job, done.existing

    async def submit_noting(self, spec: JobSpec, owner_uid: int, idempotency_key: str | None = None) -> Submitted:
        """`submit`, with what the submitter should be told (its history at its bounds)."""
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
        notices = await self._history_notices(owner_uid, spec)
        while key is not None and (pending := self._pending_keys.get(key)) is not None:
            await pending.wait()  # the same key is being saved: its outcome decides
        done = anyio.Event()
        if key is not None:
            self._pending_keys[key] = done  # from here until saved, a submit with this key waits
        try:
            if key is not None and (existing := await self.table.by_key(*key)) is not None:
                return Submitted(existing, True)
            check_limits(self.config, self.unended.values(), owner_uid)
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
        finally:
            if key is not None:
                del self._pending_keys[key]
            done.set()
        # never an environment value in the journal: the interpreter and what --export named at most
        shape: dict[str, Any] = {"python": spec.python, "export": spec.export} if spec.python else {}
        await self.journal.event(job, "job.submitted", owner_uid=owner_uid, nproc=spec.nproc,
                                 task=spec.task, script=spec.script, **shape)
        self._notify()
        return Submitted(job, False, notices)

    async def cancel(self, job: Job, reason: str, force: bool) -> None:
        if job.state.final:
            return
        job.cancel_requested = reason
        if job.state is JobState.QUEUED:
            await self.journal.job_state(job, JobState.CANCELLED, reason, finish=False)
            await self._ended(job)
            self._notify()
            return
        attempt = self.attempts.get(job.id)
        if attempt is not None:
            attempt.request_cancel(reason, force)

    async def remove(self, job: Job, uid: int) -> None:
        """`rm`: forget an ended job (row, ranks, attempts, events, logs and checkpoints); owner or root."""
        job.check_owner(uid, "remove")
        refused = lifecycle.removal_refused(job.state)
        if refused is not None:
            raise NotRunnableError(f"job {job.id}: {refused}")
        await self._delete(job)
        await self.journal.event(None, "job.removed", removed=job.id, by_uid=uid)

    def _notify(self) -> None:
        self._wake.set()

    # -- the scheduling loop ---------------------------------------------------------------

    async def run(self, tg: anyio.abc.TaskGroup) -> None:
        tg.start_soon(self.retention.run, self._prune, self._retire_history)
        self._tg = tg
        tg.start_soon(self.health.run)
        tg.start_soon(self.health.watch_idle)
        tg.start_soon(self.notifier.run)
        while True:
            await self._wake.wait()
            self._wake = anyio.Event()
            if not self.accepting:
                continue
            queue = [job for job in self.table.queued() if job.id not in self.running]  # not those started
            # a job waiting for its dependencies lets the jobs behind it start; one whose dependency
            # failed fails now, whatever the queue is waiting for
            blocked = {job.id for job in queue if dependency_ids(job.spec) and not await self._dependencies_met(job)}
            self._admit(tg, queue, blocked)

    def _admit(self, tg: anyio.abc.TaskGroup, queue: list[Job], blocked: set[str]) -> None:
        """Apply `decide.plan` (priority, fair share, submission; the head is never overtaken): start the
        jobs that may start now, preempt for the one that may, and give every other one its pending reason
        (`Job.pending`)."""
        now = self.clock()
        self._charge(self.running_jobs(), now)
        usage = {uid: u.total for uid, u in self.share.now(now).items()}
        running = [decide.Running(j, self.since.get(j.id, now)) for j in self.running_jobs()]
        queue = [j for j in queue if j.state is JobState.QUEUED]  # (not cancelled while deps were read)
        for decision in decide.plan(queue, blocked, running, usage, now, self.resources, self.config,
                                    set(self.preempting)):
            match decision:
                case decide.Start(job=job):
                    self._start(tg, job, now)
                case decide.Wait(job=job, reason=reason):
                    job.pending = reason
                case decide.Preempt(job=job, victims=victims, reason=reason):
                    job.pending = reason
                    for victim in victims:
                        self._preempt(victim, job)

    def _start(self, tg: anyio.abc.TaskGroup, job: Job, now: float) -> None:
        gpus = self.resources.take(job.spec)
        if gpus is None:  # (the plan took from a copy of the same resources: never)
            job.pending = f"resources: {self.resources.shortfall(job.spec)}"
            return
        job.pending = None
        job.gpus = gpus
        self.running.add(job.id)
        self.since[job.id] = now
        self.share.start(job, now)
        tg.start_soon(self._run_job, job)

    def _preempt(self, victim: Job, by: Job) -> None:
        """Stop `victim` at an agreed step, checkpointed, and requeue it (`AttemptEnd.PREEMPTED`)."""
        attempt = self.attempts.get(victim.id)
        if attempt is None or attempt.outcome is not None:
            return
        self.preempting[victim.id] = by.id
        if self._tg is not None:  # the event (who, for which priority) while the ranks agree on a step
            self._tg.start_soon(functools.partial(self.journal.event, victim, "job.preempt_requested", by=by.id,
                                                  by_uid=by.owner_uid, by_priority=by.spec.priority))
        attempt.conclude(Outcome(AttemptEnd.PREEMPTED, f"preempted by {by.id}", graceful=True))

    def _charge(self, jobs: list[Job], now: float) -> None:
        self.share.charge(jobs, now)
        if (users := self.share.due(now)) and self._tg is not None:  # saved now and then, not at every wake
            self._tg.start_soon(self.share.save, users)

    async def _dependencies_met(self, job: Job) -> bool:
        """Whether every job `job` waits for has SUCCEEDED; fails it when one ended otherwise."""
        pending = dependency_ids(job.spec) if job.waiting_on is None else job.waiting_on
        try:
            states = await states_of(pending, self.lookup)
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
                await self._ended(job)
                self._notify()  # the jobs that wait for this one fail in turn
            case waiting:
                job.waiting_on = waiting.on
        return False

    async def _run_job(self, job: Job) -> None:
        try:
            with structlog.contextvars.bound_contextvars(job_id=job.id):
                await self._attempts(job)
        except Exception as exc:  # a bug in one job's supervision must not take the daemon down
            log.exception("job.internal_error", job_id=job.id)
            with anyio.CancelScope(shield=True):
                await self._fail_internal(job, exc)
        finally:
            users = self.share.stop(job, self.clock())
            if users and self._tg is not None:
                self._tg.start_soon(self.share.save, users)
            self.since.pop(job.id, None)
            self.preempting.pop(job.id, None)
            self._release(job)
            self.running.discard(job.id)
            self.attempts.pop(job.id, None)
            if not self.running:
                self._idle.set()
            if self.pool is not None:
                self.pool.poke()
            self._notify()

    def _release(self, job: Job) -> None:
        """The job's CPU slots go back now, its GPUs once nothing of it can hold them (gpu.drain)."""
        gpus, job.gpus = job.gpus, []
        if not gpus or self._tg is None:
            self.resources.give_back(job.spec, gpus)
            return
        self.resources.hold(job.id, gpus)
        self._tg.start_soon(self._drain, job, gpus)

    async def _drain(self, job: Job, gpus: list[str]) -> None:
        try:
            await drain_job(job, [d for e in dict.fromkeys(gpus) if (d := self.resources.device(e))], self.journal)
        finally:
            self.resources.give_back(job.spec, gpus, job.id)
            self._notify()

    async def _attempts(self, job: Job) -> None:
        timeouts = self.timeouts(job.spec)
        multi = is_multinode(job.spec)
        nodes = NodeSession(job.spec, self.config.port_range, timeouts.join) if multi else None
        if nodes is not None:
            job.nodes = nodes.nodes
        try:
            await self._attempt_loop(job, timeouts, nodes)
        finally:
            if nodes is not None:  # (after the end's own close above: nothing more to do)
                with anyio.CancelScope(shield=True):
                    final = job.state.final
                    await nodes.close(job.state.value.lower() if final else "stopped", final=final)

    async def _attempt_loop(self, job: Job, timeouts: JobTimeouts, nodes: NodeSession | None) -> None:
        while True:
            self.preempting.pop(job.id, None)  # an attempt that ended otherwise (failed, restarts) was not preempted
            job.attempt += 1
            job.ranks = []
            job.root_cause = None
            await self.journal.job_state(job, JobState.STARTING, f"attempt {job.attempt}")
            attempt = Attempt(self.config, self.journal, job, job.attempt, timeouts, self.pool, subtree=self.subtree,
                              nodes=nodes)
            self.attempts[job.id] = attempt
            if job.cancel_requested:
                attempt.request_cancel(job.cancel_requested, force=False)
            elif not self.accepting:
                attempt.request_shutdown()
            elif (fault := self.health.fault_on(job.gpus)) is not None:  # quarantined since it was placed
                attempt.gpu_fault(fault)
            outcome = await attempt.run()
            job.root_cause = outcome.root_cause
            free = 0 if nodes is None else nodes.membership_changes  # re-forms for joining nodes: not restarts
            new = lifecycle.after_attempt(outcome.end, outcome.reason, attempt=job.attempt - free,
                                          max_restarts=job.spec.max_restarts,
                                          cancel_requested=job.cancel_requested is not None,
                                          accepting=self.accepting)
            if new is JobState.PREEMPTED:
                await self._preempted(job, outcome.reason)
                return
            if new is JobState.QUEUED:
                await self.journal.job_state(job, JobState.QUEUED, outcome.reason)
                self.notifier.post(job, "preempted")
                return
            await self.journal.job_state(job, new, outcome.reason, finish=False, root_cause=_rc(outcome))
            if new is JobState.RESTARTING:
                self.notifier.post(job, "restarting")
            if new is JobState.RESTARTING and self.health.must_move(job.gpus):  # placed again, elsewhere
                await self.journal.job_state(job, JobState.QUEUED, "gpu_quarantined")
                return
            if new is JobState.RESTARTING:
                continue
            if nodes is not None:  # the other nodes' ends read first: a `wait` returns with the final node table
                with anyio.CancelScope(shield=True):
                    await nodes.close(job.state.value.lower())
                await self.journal.save_job(job)
            await self._ended(job)
            return

    async def _preempted(self, job: Job, reason: str) -> None:
        """Its ranks stopped at an agreed step and checkpointed: PREEMPTED (who, when, at which step),
        then back in the queue to resume from that checkpoint (or CANCELLED, if a cancel came meanwhile)."""
        by = self.preempting.get(job.id)
        step = max((r.step for r in job.ranks), default=None)
        holder = self.jobs.get(by) if by is not None else None
        await self.journal.job_state(job, JobState.PREEMPTED, reason, by=by, step=step,
                                     by_uid=None if holder is None else holder.owner_uid)
        if job.cancel_requested:
            await self.journal.job_state(job, JobState.CANCELLED, job.cancel_requested, finish=False)
            await self._ended(job)
            return
        new = lifecycle.after_preemption(job.state)
        if new is not None:
            await self.journal.job_state(job, new, "preempted", by=by, step=step)
        self.notifier.post(job, "preempted")

    async def _fail_internal(self, job: Job, exc: Exception) -> None:
        """Never raises: the job ends FAILED in memory even when nothing can be written."""
        if job.state.final:
            return
        job.root_cause = RootCause(reason="internal_error", attempt=job.attempt, detail=repr(exc))
        try:
            await self.journal.job_state(job, JobState.FAILED, "internal_error", finish=False)
            await self._ended(job)
        except Exception:
            log.exception("job.internal_error_unrecorded", job_id=job.id)
            job.state, job.reason, job.finished_at = JobState.FAILED, "internal_error", self.clock()
            job.finished.set()
            job.finished.set()

    async def _ended(self, job: Job) -> None:
        """A job reached its final state: the summary event, and its place in the retention heap."""
        duration = None if job.started_at is None else round((job.finished_at or time.time()) - job.started_at, 3)
        rc = job.root_cause
        try:
            self.table.ended(job)
            self.retention.wake()
            await self.journal.event(
                job, "job.finished", state=job.state.value, reason=job.reason, duration=duration,
                attempts=job.attempt, root_cause=None if rc is None else rc.detail,
                root_cause_rank=None if rc is None else rc.rank,
            )
            self.notifier.post(job, "ended")
            await self.journal.count_stored(job.id)  # what its record takes: its owner's history bound counts it
        finally:
            job.finished.set()  # after the summary event: a `wait` returns once every event of the job is out
        self.retention.ended(job.owner_uid)  # its owner's history, against its bounds

    # -- history and retention ---------------------------------------------------------------

    async def _prune(self, job_id: str) -> None:
        job = await self.lookup(job_id)
        if job is not None:
            await self._delete(job)
            await self.journal.event(None, "job.pruned", pruned=job_id, finished_at=job.finished_at)

    async def _delete(self, job: Job) -> bool:
        """A job's rows, then its directory (logs, checkpoints); StorageError keeps everything as it was.
        Whether its rows were there (False: removed meanwhile by another path)."""
        gone = await self.journal.delete_job(job.id)
        self.table.forget(job, deleted=gone)
        path = job_dir(self.config.state_dir, job.id)  # jobs from before the per-user tree
        await anyio.to_thread.run_sync(lambda: shutil.rmtree(path, ignore_errors=True))
        try:
            await anyio.to_thread.run_sync(remove_job_dir, self.config.state_dir, job.owner_uid, job.id)
        except OSError as exc:  # a symlink or a foreign directory planted on the way: left, reported
            log.warning("job.files_not_removed", job_id=job.id, error=str(exc))
        return gone

    def _history_bounded(self) -> bool:
        return bool(self.config.max_history_per_user or self.config.max_history_bytes_per_user)

    async def _retire_history(self, uid: int) -> list[str]:
        """Retire `uid`'s oldest ended jobs past its history bounds (`retention.past_bounds`), as `rm`
        does; their ids. The live `job.pruned` of each (reason `history`) and one `job.history_retired`
        on the user's newest ended job, which stays: nothing is recorded outside the user's own jobs."""
        if not self._history_bounded():
            return []
        cfg = self.config
        async with self._retiring:
            held = await self.journal.history_of(uid)
            awaited = {dep for j in self.unended.values() for dep in dependency_ids(j.spec)}
            retired: list[str] = []
            victims = past_bounds(held, cfg.max_history_per_user, cfg.max_history_bytes_per_user, awaited)
            if len(victims) > RETIRE_BATCH:  # (a bound lowered, an upgrade): the rest by the retention task
                victims = victims[:RETIRE_BATCH]
                self.retention.ended(uid)
            for job_id in victims:
                job = await self.lookup(job_id)
                if job is None or job.owner_uid != uid or not job.state.final or not await self._delete(job):
                    continue
                retired.append(job_id)
                await self.journal.event(None, "job.pruned", persist=False, pruned=job_id, reason="history")
        newest = await self.lookup(held[-1][0]) if retired else None
        if newest is not None:
            await self.journal.event(newest, "job.history_retired", owner_uid=uid, retired=retired[:100],
                                     count=len(retired), max_history_per_user=cfg.max_history_per_user,
                                     max_history_bytes_per_user=cfg.max_history_bytes_per_user)
        return retired

    async def _history_notices(self, uid: int, spec: JobSpec) -> list[str]:
        """Before a new job of `uid` is saved: what is past its history bounds is retired now (a backlog
        the retention task has not reached: the bound holds at every submit), and the submitter is told
        when the end of this job will retire its oldest (its history with this job's spec is past a bound)."""
        if not self._history_bounded():
            return []
        cfg = self.config
        count, size = await self.journal.history_totals(uid)
        retired: list[str] = []
        if beyond_bounds(count, size, cfg.max_history_per_user, cfg.max_history_bytes_per_user):
            retired = await self._retire_history(uid)
            count, size = await self.journal.history_totals(uid)
        this = len(msgspec.json.encode(spec))  # the least its record will take
        if not retired and not beyond_bounds(count + 1, size + this, cfg.max_history_per_user,
                                             cfg.max_history_bytes_per_user):
            return []
        bounds = [f"max_history_per_user = {cfg.max_history_per_user}"] if cfg.max_history_per_user else []
        if cfg.max_history_bytes_per_user:
            bounds.append(f"max_history_bytes_per_user = {_size(cfg.max_history_bytes_per_user)}")
        text = (f"your history is at its bound: {count} ended jobs kept, {_size(size)} ({', '.join(bounds)}); "
                "as your jobs end, your oldest ended jobs are retired with their logs and checkpoints "
                "(`ddpctl rm` chooses which go first)")
        if retired:
            named = ", ".join(retired[:RETIRED_NAMED])
            more = f" and {len(retired) - RETIRED_NAMED} more" if len(retired) > RETIRED_NAMED else ""
            text += f"; retired now: {named}{more}"
        return [text]

    # -- shutdown --------------------------------------------------------------------------

    async def shutdown(self, force: bool) -> None:
        """Stop taking work; running jobs stop gracefully (or are killed at once) and go back to the queue."""
        self.accepting = False
        for attempt in list(self.attempts.values()):
            if force:
                attempt.force()
            else:
                attempt.request_shutdown()
        if self.running:
            self._idle = anyio.Event()
            await self._idle.wait()
        await self.share.save(list(self.share.usage))  # what the last jobs used, before the loop is cancelled

    # -- recovery --------------------------------------------------------------------------

    async def recover(self) -> None:
        """Load every job; kill what is left of jobs that were running; keep the queue in order."""
        await self.table.load()
        await self.share.load()  # before the first placement and the first `share` request
        # before the first placement and before the daemon says it is ready (a `daemon` request shows
        # the quarantine at once): a quarantined GPU stays out
        await self.health.load()
        for job in list(self.unended.values()):
            new = lifecycle.after_daemon_restart(job.state, attempt=job.attempt, max_restarts=job.spec.max_restarts)
            if new is None:
                continue
            killed = await self._kill_attempt_leftovers(job)
            if new is JobState.FAILED:
                job.root_cause = RootCause(reason="daemon_restart", attempt=job.attempt,
                                           detail="the daemon stopped while the job was running")
            await self.journal.job_state(job, new, "daemon_restart", finish=False, killed=killed)
            if new.final:
                await self._ended(job)
        self._notify()

    async def _kill_attempt_leftovers(self, job: Job) -> list[int]:
        killed: list[int] = []
        for path in await self.journal.attempt_cgroups(job.id, job.attempt):  # the cgroup first: it misses nothing
            killed += await anyio.to_thread.run_sync(kill_cgroup, path)
        for token in await self.journal.attempt_tokens(job.id, job.attempt):
            marker = marker_entry(job.id, job.attempt, token)
            killed += await anyio.to_thread.run_sync(kill_marked, marker)
        if killed:
            await self.journal.event(job, "job.leftover_killed", pids=killed, reason="daemon_restart")
        return killed


def _size(n: int) -> str:
    return f"{n / MIB:.3g} MiB" if n >= MIB else f"{n / 1024:.3g} KiB"


def _rc(outcome: Outcome) -> str | None:
    return None if outcome.root_cause is None else outcome.root_cause.detail
