"""The daemon's jobs as the control socket and the metrics endpoint see them, and the queue `app` runs.

`Jobs` is the one surface control and metrics call, eight methods grouped by purpose: a job by its
id (`find`) and a page of jobs (`page`); what a request does to jobs (`submit`, `cancel`, `remove`,
`stacks`, `release_gpu`); and what the views read, one frozen `Overview` of the jobs at one instant
(running jobs, counts by state, CPU slots and GPUs; the queue positions and the share table where
asked for). Control never
holds a part of the queue, nor the lifecycle.

`JobQueue` builds the parts (table, fair share, retention and history, GPU quarantine, hooks,
runners, scheduler) over one `LiveConfig`, and is the lifecycle `app` alone drives: `recover` at
start, `run` its tasks, `reconfigure` after a reload (the live config replaced once, then what a new
config changes at once: CPU slots, a retention look, a placement), `shutdown` and `force_stop`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal, overload

import anyio

from ...protocol import JobSpec, JobState
from ...protocol.control import ShareView, StacksResult
from ..config import Config
from ..contain.cgroups import Subtree
from ..gpu.utilisation import UtilisationLog
from ..multinode.placement import check_rank, held_ranks
from ..pool.pool import WarmPool
from ..run.lifecycle import ACTIVE
from ..store.errors import NotRunnableError
from ..store.journal import Journal
from ..store.quarantine import Quarantined
from ..store.records import Job
from .commands import Stop
from .ends import JobEnds
from .fairshare import FairShare, share_views
from .gpuhealth import GpuHealth
from .history import History
from .jobids import resolve
from .live import LiveConfig
from .notifyhooks import JobHooks
from .recovery import recover_jobs
from .resources import Resources
from .retention import Retention
from .runner import Supervision
from .runners import Runners
from .scheduler import Scheduler, Submitted
from .table import HISTORY_IN_MEMORY, JobTable

__all__ = ["JobQueue", "Jobs", "LiveConfig", "Overview", "Submitted"]


@dataclass(frozen=True)
class Overview:
    """The jobs at one instant, as the views (status, list, share, daemon info, metrics) read them."""

    accepting: bool  # False once the daemon stops: a submit is refused
    running: tuple[Job, ...]  # the started jobs not yet ended (they hold their resources)
    states: Mapping[JobState, int]  # jobs on record, by state
    active: int  # jobs starting or running (restarts included), by their recorded state
    queued: int  # jobs queued, by their recorded state
    positions: Mapping[str, int]  # `order` only: each queued job's place in line (1: the next to start)
    shares: tuple[ShareView, ...]  # `order` only: each user's usage and fair-share factor (queue.fairshare)
    half_life: float  # of usage, seconds (0: no decay)
    cpu_slots: int
    free_cpu_slots: int
    gpus: int
    free_gpus: int


class Jobs:
    """What control and metrics ask of the queue; built by `JobQueue`."""

    def __init__(self, queue: JobQueue) -> None:
        self._q = queue

    @overload
    async def find(self, job_id: str, *, missing_ok: Literal[False] = False) -> Job: ...

    @overload
    async def find(self, job_id: str, *, missing_ok: Literal[True]) -> Job | None: ...

    async def find(self, job_id: str, *, missing_ok: bool = False) -> Job | None:
        """The job `job_id` names: its id or a unique prefix (not_found, ambiguous: see jobids); with
        `missing_ok`, a whole id (as an event names its job) and None where there is no such job."""
        if missing_ok:
            return await self._q.table.lookup(job_id)
        return await resolve(self._q.table, job_id)

    async def page(self, limit: int, before: int | None = None, *, owner_uid: int | None = None,
                   active: bool = False) -> list[Job]:
        """Up to `limit` jobs with seq below `before`, newest first."""
        return await self._q.table.page(limit, before, owner_uid=owner_uid, active=active)

    async def submit(self, spec: JobSpec, owner_uid: int, idempotency_key: str | None = None) -> Submitted:
        """Check, save, then publish a job (`scheduler.Submitted`)."""
        return await self._q.scheduler.submit(spec, owner_uid, idempotency_key)

    async def cancel(self, job: Job, reason: str, force: bool) -> None:
        await self._q.scheduler.cancel(job, reason, force)

    async def remove(self, job: Job, uid: int) -> None:
        """`rm`: forget an ended job; owner or root."""
        await self._q.history.remove(job, uid)

    async def stacks(self, job: Job, rank: int | None, native: bool) -> StacksResult:
        """The running job's stacks (py-spy): NotRunnableError where it runs no attempt, a rank error
        (multinode.placement.check_rank) for a rank its attempt does not hold."""
        runner = self._q.runners.get(job.id)
        attempt = None if runner is None or job.state.final else runner.attempt
        if attempt is None:
            raise NotRunnableError(f"job {job.id} is {job.state.value}, not running")
        if rank is not None:
            check_rank(job, rank, await held_ranks(self._q.journal, job, job.attempt))
        return await attempt.stacks(rank, native)

    async def release_gpu(self, name: str, uid: int) -> Quarantined:
        """Lift a GPU's quarantine (NotFoundError: no such GPU, or not quarantined)."""
        record = await self._q.health.release(name, uid)
        self._q.scheduler.wake()  # a released GPU may let queued jobs start
        return record

    def overview(self, *, order: bool = False) -> Overview:
        """The jobs now (read between two of their changes: no await here). With `order`, the queue's
        order and the share table too (each a pass over the queue by fair share: 0.5 ms and more at
        a thousand queued jobs, so a submit or a status line does without); without, both are empty."""
        q = self._q
        states = [j.state for j in q.table.jobs.values()]
        positions: Mapping[str, int] = {}
        shares: list[ShareView] = []
        if order:  # the share table's usage as of before this charge (fair_factors charges the running jobs)
            usage = q.share.now(q.clock())
            shares = share_views(usage, q.scheduler.fair_factors(frozenset(usage)), q.table.unended.values(),
                                 q.runners.ids())
            positions = q.scheduler.queue_positions()
        res = q.resources
        return Overview(accepting=q.scheduler.accepting, running=tuple(q.runners.running_jobs()),
                        states=q.table.state_counts(), active=sum(s in ACTIVE for s in states),
                        queued=states.count(JobState.QUEUED), positions=positions, shares=tuple(shares),
                        half_life=q.share.half_life, cpu_slots=res.total_cpu, free_cpu_slots=res.free_cpu,
                        gpus=res.total_gpus, free_gpus=len(res.free_gpus))


class JobQueue:
    """The queue's parts over one live config, and their lifecycle (`app` only); `jobs` is the facade."""

    def __init__(self, live: LiveConfig, journal: Journal, resources: Resources, pool: WarmPool | None = None,
                 clock: Callable[[], float] = time.time, subtree: Subtree | None = None,
                 utilization: UtilisationLog | None = None, ended_held: int = HISTORY_IN_MEMORY) -> None:
        self.live = live
        self.journal = journal
        self.resources = resources
        self.clock = clock  # wall-clock time (retention and fair share are counted in it)
        self.table = table = JobTable(journal, ended_held)  # every unended job and the most recent ended ones
        self.retention = Retention(journal, live, clock)
        self.history = History(live, journal, table, self.retention)
        self.hooks = JobHooks(live, journal, subtree)  # each job's hooks, as its submitter
        self.runners = Runners(table)
        self.health = GpuHealth(journal, resources, self.runners, live, utilization)
        self.share = FairShare(journal, live)  # each user's recent usage
        self.ends = JobEnds(journal, table, self.retention, self.hooks, clock)
        sup = Supervision(live, journal, pool, subtree, self.health, self.hooks, self.ends)
        self.scheduler = Scheduler(sup, resources, table, self.runners, self.share, self.history, clock)
        self.jobs = Jobs(self)

    def reconfigure(self, config: Config) -> None:
        """A reloaded config: every part reads it from now on; CPU slots resized, retention and
        placement looked at again (a raised limit may let queued jobs start)."""
        self.live.replace(config)
        self.resources.resize_cpu(config.cpu_slots)
        self.retention.wake()
        self.scheduler.wake()

    async def recover(self) -> None:
        """Load every job; kill what is left of jobs that were running; keep the queue in order."""
        await self.table.load()
        await self.share.load()  # before the first placement and the first `share` request
        # before the first placement and before the daemon says it is ready (a `daemon` request shows
        # the quarantine at once): a quarantined GPU stays out
        await self.health.load()
        await recover_jobs(self.table.unended.values(), self.journal, self.ends)
        self.scheduler.wake()

    async def run(self) -> None:
        """Every task of the queue (retention, GPU watches, hooks, placement), until cancelled."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.retention.run, self.history.prune, self.history.retire)
            tg.start_soon(self.health.run)
            tg.start_soon(self.health.watch_idle)
            tg.start_soon(self.hooks.run)
            tg.start_soon(self.scheduler.run)

    async def shutdown(self, force: bool) -> None:
        """Stop taking work; running jobs stop gracefully (or are killed at once) and go back to the queue."""
        await self.scheduler.shutdown(force)

    async def force_stop(self) -> None:
        """A second stop signal: no more grace for the running jobs."""
        await self.runners.tell_all(Stop(force=True))
