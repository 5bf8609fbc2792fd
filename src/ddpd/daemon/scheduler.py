"""The durable queue: admission, resources, one runner task per job, restarts, recovery."""

from __future__ import annotations

import os
import secrets
import signal
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import structlog

from ..protocol import JobSpec, JobState, SpecError, check_spec
from ..protocol.control import RootCause
from .config import Config
from .jobs import Job, Journal, job_from_row, rank_from_row
from .pool import WarmPool
from .procs import find_members, proc_environ_has
from .supervisor import Attempt, Outcome

log = structlog.get_logger("ddpd")


class Resources:
    """GPUs (by index) and CPU slots; a job takes all it needs or waits."""

    def __init__(self, gpus: int, cpu_slots: int) -> None:
        self.total_gpus = gpus
        self.free_gpus = list(range(gpus))
        self.total_cpu = cpu_slots
        self.free_cpu = cpu_slots

    @staticmethod
    def need(spec: JobSpec) -> tuple[int, int]:
        gpus = spec.nproc * spec.gpus_per_rank
        return gpus, (0 if gpus else spec.nproc)

    def can_ever_fit(self, spec: JobSpec) -> str | None:
        gpus, cpu = self.need(spec)
        if gpus > self.total_gpus:
            return (f"needs {gpus} GPUs ({spec.nproc} ranks x {spec.gpus_per_rank}) but the daemon has "
                    f"{self.total_gpus}")
        if cpu > self.total_cpu:
            return f"needs {cpu} CPU slots ({spec.nproc} ranks) but the daemon has {self.total_cpu}"
        return None

    def take(self, spec: JobSpec) -> list[int] | None:
        gpus, cpu = self.need(spec)
        if gpus > len(self.free_gpus) or cpu > self.free_cpu:
            return None
        taken, self.free_gpus = self.free_gpus[:gpus], self.free_gpus[gpus:]
        self.free_cpu -= cpu
        return taken

    def busy_cpu(self) -> int:
        """CPU slots held by running jobs (ranks that occupy a CPU; GPU jobs mostly wait on their devices)."""
        return self.total_cpu - self.free_cpu

    def give_back(self, spec: JobSpec, gpus: list[int]) -> None:
        self.free_gpus = sorted(self.free_gpus + gpus)
        self.free_cpu += self.need(spec)[1]


class Scheduler:
    def __init__(self, config: Config, journal: Journal, resources: Resources, pool: WarmPool | None = None) -> None:
        self.config = config
        self.pool = pool
        self.journal = journal
        self.resources = resources
        self.jobs: dict[str, Job] = {}
        self.attempts: dict[str, Attempt] = {}
        self.running: set[str] = set()
        self._wake = anyio.Event()
        self._seq = 0
        self.accepting = True
        self._idle = anyio.Event()

    # -- queries ---------------------------------------------------------------------------

    def counts(self) -> tuple[int, int]:
        queued = sum(1 for j in self.jobs.values() if j.state is JobState.QUEUED)
        return len(self.running), queued

    def timeouts(self, spec: JobSpec) -> dict[str, Any]:
        d = self.config.defaults
        t = spec.timeouts
        return {
            "join": t.join or d.join,
            "heartbeat": t.heartbeat or d.heartbeat,
            "progress": t.progress or d.progress,
            "wall": t.wall or d.wall,
            "kill_grace": t.kill_grace or d.kill_grace,
            "stop_warning": t.stop_warning or d.stop_warning,
        }

    # -- admission -------------------------------------------------------------------------

    async def submit(self, spec: JobSpec, owner_uid: int) -> Job:
        spec = check_spec(spec)
        await anyio.to_thread.run_sync(_check_paths, spec)
        if spec.device == "cuda" and self.resources.total_gpus == 0:
            raise SpecError("device", "cuda was asked for but the daemon has no GPUs")
        problem = self.resources.can_ever_fit(spec)
        if problem:
            raise SpecError("nproc" if "CPU" in problem else "gpus_per_rank", f"can never run here: {problem}")
        self._seq += 1
        job = Job(
            id=f"j{self._seq}-{secrets.token_hex(2)}",
            seq=self._seq,
            name=spec.name or (spec.task or os.path.basename(spec.script[0] if spec.script else "job")),
            owner_uid=owner_uid,
            spec=spec,
            state=JobState.QUEUED,
            submitted_at=time.time(),
        )
        self.jobs[job.id] = job
        await self.journal.save_job(job)
        await self.journal.event(job, "job.submitted", owner_uid=owner_uid, nproc=spec.nproc,
                                 task=spec.task, script=spec.script)
        self._notify()
        return job

    async def cancel(self, job: Job, reason: str, force: bool) -> None:
        if job.state.final:
            return
        job.cancel_requested = reason
        if job.state is JobState.QUEUED:
            await self.journal.job_state(job, JobState.CANCELLED, reason)
            await self._finished_event(job)
            self._notify()
            return
        attempt = self.attempts.get(job.id)
        if attempt is not None:
            attempt.request_cancel(reason, force)

    def _notify(self) -> None:
        self._wake.set()

    # -- the scheduling loop ---------------------------------------------------------------

    async def run(self, tg: anyio.abc.TaskGroup) -> None:
        while True:
            await self._wake.wait()
            self._wake = anyio.Event()
            if not self.accepting:
                continue
            queued = sorted(
                (j for j in self.jobs.values() if j.state is JobState.QUEUED and j.id not in self.running),
                key=lambda j: (-j.spec.priority, j.seq),
            )
            for job in queued:  # strict order: the head of the queue is never overtaken
                if len(self.running) >= self.config.max_running:
                    break
                gpus = self.resources.take(job.spec)
                if gpus is None:
                    break
                job.gpus = gpus
                self.running.add(job.id)
                tg.start_soon(self._run_job, job)

    async def _run_job(self, job: Job) -> None:
        try:
            with structlog.contextvars.bound_contextvars(job_id=job.id):
                await self._attempts(job)
        except Exception as exc:  # a bug in one job's supervision must not take the daemon down
            log.exception("job.internal_error", job_id=job.id)
            with anyio.CancelScope(shield=True):
                await self._fail_internal(job, exc)
        finally:
            self.resources.give_back(job.spec, job.gpus)
            job.gpus = []
            self.running.discard(job.id)
            self.attempts.pop(job.id, None)
            if not self.running:
                self._idle.set()
            if self.pool is not None:
                self.pool.poke()
            self._notify()

    async def _attempts(self, job: Job) -> None:
        timeouts = self.timeouts(job.spec)
        while True:
            job.attempt += 1
            job.ranks = []
            job.root_cause = None
            await self.journal.job_state(job, JobState.STARTING, f"attempt {job.attempt}")
            attempt = Attempt(self.config, self.journal, job, job.attempt, timeouts, self.pool)
            self.attempts[job.id] = attempt
            if job.cancel_requested:
                attempt.request_cancel(job.cancel_requested, force=False)
            elif not self.accepting:
                attempt.request_shutdown()
            outcome = await attempt.run()
            job.root_cause = outcome.root_cause
            if outcome.state is JobState.QUEUED:
                await self.journal.job_state(job, JobState.QUEUED, outcome.reason)
                return
            restarts_used = job.attempt - 1
            out_of_time = outcome.reason == "wall_time"  # wall time counts from the first start
            if (outcome.state in (JobState.FAILED, JobState.TIMED_OUT) and restarts_used < job.spec.max_restarts
                    and not out_of_time and not job.cancel_requested and self.accepting):
                await self.journal.job_state(job, JobState.RESTARTING, outcome.reason,
                                             root_cause=_rc(outcome))
                continue
            await self.journal.job_state(job, outcome.state, outcome.reason, root_cause=_rc(outcome))
            await self._finished_event(job)
            return

    async def _fail_internal(self, job: Job, exc: Exception) -> None:
        if job.state.final:
            return
        job.root_cause = RootCause(reason="internal_error", attempt=job.attempt, detail=repr(exc))
        await self.journal.job_state(job, JobState.FAILED, "internal_error")
        await self._finished_event(job)

    async def _finished_event(self, job: Job) -> None:
        duration = None if job.started_at is None else round((job.finished_at or time.time()) - job.started_at, 3)
        rc = job.root_cause
        await self.journal.event(
            job, "job.finished", state=job.state.value, reason=job.reason, duration=duration,
            attempts=job.attempt, root_cause=None if rc is None else rc.detail,
            root_cause_rank=None if rc is None else rc.rank,
        )

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

    # -- recovery --------------------------------------------------------------------------

    async def recover(self) -> None:
        """Load every job; kill what is left of jobs that were running; keep the queue in order."""
        rows = await self.journal.db.query("SELECT * FROM jobs ORDER BY seq")
        for row in rows:
            job = job_from_row(row)
            self.jobs[job.id] = job
            self._seq = max(self._seq, job.seq)
            ranks = await self.journal.db.query(
                "SELECT * FROM ranks WHERE job_id = ? AND attempt = ? ORDER BY rank", (job.id, job.attempt))
            job.ranks = [rank_from_row(r) for r in ranks]
            if job.state.final:
                job.finished.set()
        for job in self.jobs.values():
            if job.state in (JobState.STARTING, JobState.RUNNING, JobState.RESTARTING):
                killed = await self._kill_attempt_leftovers(job)
                restarts_used = job.attempt
                if restarts_used <= job.spec.max_restarts:
                    await self.journal.job_state(job, JobState.QUEUED, "daemon_restart", killed=killed)
                else:
                    job.root_cause = RootCause(reason="daemon_restart", attempt=job.attempt,
                                               detail="the daemon stopped while the job was running")
                    await self.journal.job_state(job, JobState.FAILED, "daemon_restart", killed=killed)
                    await self._finished_event(job)
        self._notify()

    async def _kill_attempt_leftovers(self, job: Job) -> list[int]:
        rows = await self.journal.db.query(
            "SELECT pgid, token FROM attempts WHERE job_id = ? AND attempt = ?", (job.id, job.attempt))
        killed: list[int] = []
        for row in rows:
            marker = f"DDPD_ATTEMPT={job.id}:{job.attempt}:{row['token']}".encode()
            members = await anyio.to_thread.run_sync(find_members, None, marker)
            for p in members:
                # checked against /proc just before signalling: only this attempt's processes
                if proc_environ_has(p.pid, marker):
                    try:
                        os.kill(p.pid, signal.SIGKILL)
                        killed.append(p.pid)
                    except ProcessLookupError:
                        pass
        if killed:
            await self.journal.event(job, "job.leftover_killed", pids=killed, reason="daemon_restart")
        return killed


def _rc(outcome: Outcome) -> str | None:
    return None if outcome.root_cause is None else outcome.root_cause.detail


def _check_paths(spec: JobSpec) -> None:
    if spec.workdir is not None and not Path(spec.workdir).is_dir():
        raise SpecError("workdir", f"{spec.workdir} is not a directory")
    if spec.script is not None and not spec.module:
        path = Path(spec.script[0])
        if not path.is_absolute():
            if spec.workdir is None:
                raise SpecError("script", f"relative script path {spec.script[0]!r} needs a workdir")
            path = Path(spec.workdir) / path
        if not path.is_file():
            raise SpecError("script", f"{path} does not exist")
