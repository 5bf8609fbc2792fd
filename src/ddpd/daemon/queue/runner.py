"""One job's supervision from its start to its end or its return to the queue: the `JobRunner`.

The runner is the only writer of its job's state (besides the journal, which records it): it runs
the job's attempts one after another (`attempt.Attempt`), applies `run.lifecycle`'s decision after
each (restart, requeue, preempted, final), and ends the job (`ends.JobEnds`). Whatever else must
act on the job sends it a command (`commands`: cancel, GPU fault, the daemon's stop, preempt) on its
command stream; the runner applies them in its own task, to the attempt running then and to those
it starts later. `run` returns how the job left it (`commands.RunEnd`); the scheduler then gives
back its resources.

A command sent after the runner ended is dropped; `send` returns an event set once the command was
applied (or dropped), for a caller that must see its effect (a cancel's reply says what it did).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, assert_never

import anyio
import anyio.abc
import structlog

from ...protocol import JobState
from ...protocol.spec import is_multinode
from ...protocol.timeouts import Timeouts, need
from ..attempt.attempt import Attempt, Outcome
from ..config import Config
from ..contain.cgroups import Subtree
from ..multinode.nodes import NodeSession
from ..pool.pool import WarmPool
from ..run import lifecycle
from ..run.outcome import AttemptEnd
from ..store.journal import Journal
from ..store.records import Job
from .commands import Cancel, Command, Ended, GpuFault, Preempt, Requeued, RunEnd, Stop
from .ends import JobEnds
from .live import LiveConfig
from .notifyhooks import JobHooks

log = structlog.get_logger("ddpd")


class Quarantine(Protocol):
    """What a runner asks of the GPU quarantine (queue.gpuhealth) before and after an attempt."""

    def fault_on(self, gpus: list[str]) -> str | None: ...

    def must_move(self, gpus: list[str]) -> bool: ...


@dataclass(frozen=True)
class Supervision:
    """What every runner works with: the daemon's current config (a reload replaces it: new attempts
    use it), the journal, the warm pool, the cgroup subtree, the quarantine, the hooks, the end."""

    live: LiveConfig
    journal: Journal
    pool: WarmPool | None
    subtree: Subtree | None
    quarantine: Quarantine
    hooks: JobHooks
    ends: JobEnds

    @property
    def config(self) -> Config:
        """The daemon's config now (`live.LiveConfig`): an attempt is given it when it starts."""
        return self.live.current


class JobRunner:
    def __init__(self, job: Job, sup: Supervision) -> None:
        self.job = job
        self.sup = sup
        self.attempt: Attempt | None = None  # the latest attempt (its stacks are read while it runs)
        self._stop: Stop | None = None  # the daemon stops: every attempt from now goes back to the queue
        self._preempt: Preempt | None = None  # the preemption this attempt was asked for
        self._send, self._receive = anyio.create_memory_object_stream[tuple[Command, anyio.Event]](math.inf)

    def send(self, command: Command) -> anyio.Event:
        """Queue `command` for the runner (never blocks); the event is set once it was applied or dropped."""
        done = anyio.Event()
        try:
            self._send.send_nowait((command, done))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            done.set()  # the runner ended: its job has nothing left to stop
        return done

    async def run(self) -> RunEnd:
        """Supervise the job until it ends or goes back to the queue; never raises but cancellation."""
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._commands)
                end = await self._supervise()
                tg.cancel_scope.cancel()  # the commands' task: nothing is left to command
        finally:
            self._close()
        return end

    async def _supervise(self) -> RunEnd:
        job = self.job
        try:
            with structlog.contextvars.bound_contextvars(job_id=job.id):
                return await self._attempts()
        except Exception as exc:  # a bug in one job's supervision must not take the daemon down
            log.exception("job.internal_error", job_id=job.id)
            with anyio.CancelScope(shield=True):
                await self.sup.ends.fail_internal(job, exc)
            return Ended()

    def _close(self) -> None:
        """Commands that came after the end are dropped, their senders told; later ones are refused."""
        while True:
            try:
                _, done = self._receive.receive_nowait()
            except anyio.WouldBlock:
                break
            done.set()
        self._receive.close()
        self._send.close()

    async def _commands(self) -> None:
        async for command, done in self._receive:
            try:
                await self._apply(command)
            finally:
                done.set()

    async def _apply(self, command: Command) -> None:
        job, attempt = self.job, self.attempt
        match command:
            case Cancel(reason=reason, force=force):
                job.cancel_requested = reason
                if attempt is not None:
                    attempt.request_cancel(reason, force)
            case GpuFault(detail=detail):
                if attempt is not None:
                    attempt.gpu_fault(detail)
            case Stop(force=force):
                self._stop = command
                if attempt is not None and force:
                    attempt.force()
                elif attempt is not None:
                    attempt.request_shutdown()
            case Preempt():
                if attempt is None or attempt.outcome is not None or command.attempt != job.attempt:
                    return
                self._preempt = command
                # the event (who, for which priority) before the ranks agree on a step
                await self.sup.journal.event(job, "job.preempt_requested", by=command.by, by_uid=command.by_uid,
                                             by_priority=command.by_priority)
                attempt.conclude(Outcome(AttemptEnd.PREEMPTED, f"preempted by {command.by}", graceful=True))
            case _:
                assert_never(command)

    async def _attempts(self) -> RunEnd:
        job = self.job
        timeouts = job.spec.timeouts.over(self.sup.config.defaults)
        join = need(timeouts.join)
        nodes = NodeSession(job.spec, self.sup.config.port_range, join) if is_multinode(job.spec) else None
        if nodes is not None:
            job.nodes = nodes.nodes
        try:
            return await self._attempt_loop(timeouts, nodes)
        finally:
            if nodes is not None:  # (after the end's own close: nothing more to do)
                with anyio.CancelScope(shield=True):
                    final = job.state.final
                    await nodes.close(job.state.value.lower() if final else "stopped", final=final)

    async def _attempt_loop(self, timeouts: Timeouts, nodes: NodeSession | None) -> RunEnd:
        job, journal = self.job, self.sup.journal
        while True:
            self._preempt = None  # an attempt that ended otherwise (failed, restarts) was not preempted
            attempt = await self._start_attempt(timeouts, nodes)
            outcome = await attempt.run()
            job.root_cause = outcome.root_cause
            free = 0 if nodes is None else nodes.membership_changes  # re-forms for joining nodes: not restarts
            new = lifecycle.after_attempt(outcome.end, outcome.reason, attempt=job.attempt - free,
                                          max_restarts=job.spec.max_restarts,
                                          cancel_requested=job.cancel_requested is not None,
                                          accepting=self._stop is None)
            match new:
                case JobState.PREEMPTED:
                    return await self._preempted(outcome.reason)
                case JobState.QUEUED:  # the daemon stops: no notice (never `preempted`: it was not)
                    await journal.job_state(job, JobState.QUEUED, outcome.reason)
                    return Requeued(outcome.reason)
                case JobState.RESTARTING:
                    await journal.job_state(job, new, outcome.reason, finish=False, root_cause=_rc(outcome))
                    self.sup.hooks.post(job, "restarting")
                    if self.sup.quarantine.must_move(job.gpus):  # placed again, elsewhere
                        await journal.job_state(job, JobState.QUEUED, "gpu_quarantined")
                        return Requeued("gpu_quarantined")
                case _:
                    await journal.job_state(job, new, outcome.reason, finish=False, root_cause=_rc(outcome))
                    return await self._end(nodes)

    async def _start_attempt(self, timeouts: Timeouts, nodes: NodeSession | None) -> Attempt:
        job, sup = self.job, self.sup
        job.attempt += 1
        job.ranks = []
        job.root_cause = None
        await sup.journal.job_state(job, JobState.STARTING, f"attempt {job.attempt}")
        attempt = Attempt(sup.config, sup.journal, job, job.attempt, timeouts, sup.pool, subtree=sup.subtree,
                          nodes=nodes)
        self.attempt = attempt
        if job.cancel_requested:
            attempt.request_cancel(job.cancel_requested, force=False)
        elif self._stop is not None:
            attempt.request_shutdown()
        elif (fault := sup.quarantine.fault_on(job.gpus)) is not None:  # quarantined since it was placed
            attempt.gpu_fault(fault)
        return attempt

    async def _end(self, nodes: NodeSession | None) -> RunEnd:
        job = self.job
        if nodes is not None:  # the other nodes' ends read first: a `wait` returns with the final node table
            with anyio.CancelScope(shield=True):
                await nodes.close(job.state.value.lower())
            await self.sup.journal.save_job(job)
        await self.sup.ends.ended(job)
        return Ended()

    async def _preempted(self, reason: str) -> RunEnd:
        """Its ranks stopped at an agreed step and checkpointed: PREEMPTED (who, when, at which step),
        then back in the queue to resume from that checkpoint (or CANCELLED, if a cancel came meanwhile)."""
        job, journal, asked = self.job, self.sup.journal, self._preempt
        by = None if asked is None else asked.by
        step = max((r.step for r in job.ranks), default=None)
        await journal.job_state(job, JobState.PREEMPTED, reason, by=by, step=step,
                                by_uid=None if asked is None else asked.by_uid)
        if job.cancel_requested:
            await journal.job_state(job, JobState.CANCELLED, job.cancel_requested, finish=False)
            await self.sup.ends.ended(job)
            return Ended()
        new = lifecycle.after_preemption(job.state)
        if new is not None:
            await journal.job_state(job, new, "preempted", by=by, step=step)
        self.sup.hooks.post(job, "preempted")
        return Requeued("preempted")


def _rc(outcome: Outcome) -> str | None:
    return None if outcome.root_cause is None else outcome.root_cause.detail
