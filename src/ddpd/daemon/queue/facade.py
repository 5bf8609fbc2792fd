"""The daemon's jobs as the control socket, the metrics endpoint and `app` see them: one narrow surface.

`Jobs` builds the queue's parts (table, fair share, retention and history, GPU quarantine, hooks,
runners, scheduler), runs their tasks (`run`), recovers them at start and stops them at the end;
callers ask it, never the parts: submit, cancel, remove, find and page jobs, a running job's stacks,
a GPU's release, the share table, and what the views read (the current config, the journal, the
resources, the GPUs' utilisation, the running jobs).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio

from ...protocol import JobSpec, JobState
from ...protocol.control import ShareView, StacksResult
from ..config import Config
from ..contain.cgroups import Subtree
from ..gpu.utilisation import UtilisationLog
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
from .notifyhooks import JobHooks
from .recovery import recover_jobs
from .resources import Resources
from .retention import Retention
from .runner import Supervision
from .runners import Runners
from .scheduler import Scheduler, Submitted
from .table import JobTable


class Jobs:
    def __init__(self, config: Config, journal: Journal, resources: Resources, pool: WarmPool | None = None,
                 clock: Callable[[], float] = time.time, subtree: Subtree | None = None) -> None:
        self.journal = journal
        self.resources = resources
        self.subtree = subtree  # where attempts get their cgroups; None: process groups and markers only
        self.clock = clock  # wall-clock time (retention and fair share are counted in it)
        self.table = table = JobTable(journal)  # every unended job and the most recent ended ones
        self.retention = Retention(journal, config.retention, clock)
        self.history = History(config, journal, table, self.retention)
        self.hooks = JobHooks(config, journal, subtree)  # each job's hooks, as its submitter
        self.runners = Runners(table)
        self.health = GpuHealth(journal, resources, self.runners, config)
        self.share = FairShare(journal, config.fairshare_half_life)  # each user's recent usage
        ends = JobEnds(journal, table, self.retention, self.hooks, clock)
        self.supervision = Supervision(config, journal, pool, subtree, self.health, self.hooks, ends)
        self.scheduler = Scheduler(self.supervision, resources, table, self.runners, self.share, self.history, clock)

    # -- the daemon's side -----------------------------------------------------------------

    @property
    def config(self) -> Config:
        """The current config (`reconfigure`)."""
        return self.supervision.config

    @property
    def accepting(self) -> bool:
        return self.scheduler.accepting

    @property
    def utilization(self) -> UtilisationLog:
        return self.health.utilization

    def reconfigure(self, config: Config) -> None:
        """A reloaded config: limits and defaults for new attempts, CPU slots, retention, hooks, idle GPUs."""
        self.resources.resize_cpu(config.cpu_slots)
        self.supervision.config = config
        self.history.reconfigure(config)
        self.health.reconfigure(config)
        self.hooks.reconfigure(config)
        self.retention.reconfigure(config.retention)
        self.scheduler.wake()  # a raised limit may let queued jobs start

    async def recover(self) -> None:
        """Load every job; kill what is left of jobs that were running; keep the queue in order."""
        await self.table.load()
        await self.share.load()  # before the first placement and the first `share` request
        # before the first placement and before the daemon says it is ready (a `daemon` request shows
        # the quarantine at once): a quarantined GPU stays out
        await self.health.load()
        await recover_jobs(self.table.unended.values(), self.journal, self.supervision.ends)
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

    # -- requests --------------------------------------------------------------------------

    async def submit(self, spec: JobSpec, owner_uid: int, idempotency_key: str | None = None) -> Submitted:
        """Check, save, then publish a job (`scheduler.Submitted`)."""
        return await self.scheduler.submit(spec, owner_uid, idempotency_key)

    async def cancel(self, job: Job, reason: str, force: bool) -> None:
        await self.scheduler.cancel(job, reason, force)

    async def remove(self, job: Job, uid: int) -> None:
        """`rm`: forget an ended job; owner or root."""
        await self.history.remove(job, uid)

    async def resolve(self, job_id: str) -> Job:
        """The job a request names: its id or a unique prefix (not_found, ambiguous: see jobids)."""
        return await resolve(self.table, job_id)

    async def lookup(self, job_id: str) -> Job | None:
        """A job by id, held in memory or read from the journal (None: no such job)."""
        return await self.table.lookup(job_id)

    async def page(self, limit: int, before: int | None = None, *, owner_uid: int | None = None,
                   active: bool = False) -> list[Job]:
        """Up to `limit` jobs with seq below `before`, newest first."""
        return await self.table.page(limit, before, owner_uid=owner_uid, active=active)

    def queue_positions(self) -> dict[str, int]:
        return self.scheduler.queue_positions()

    def running_jobs(self) -> list[Job]:
        """The started jobs not yet ended (they hold their resources)."""
        return self.runners.running_jobs()

    def state_counts(self) -> dict[JobState, int]:
        return self.table.state_counts()

    def active_and_queued(self) -> tuple[int, int]:
        """Jobs starting or running (restarts included), and jobs queued, by their recorded state."""
        states = [j.state for j in self.table.jobs.values()]
        return sum(s in ACTIVE for s in states), states.count(JobState.QUEUED)

    def runs(self, job: Job) -> bool:
        """Whether the job runs an attempt now (its stacks can be read)."""
        runner = self.runners.get(job.id)
        return runner is not None and runner.attempt is not None and not job.state.final

    async def stacks(self, job: Job, rank: int | None, native: bool) -> StacksResult:
        """The running job's stacks (py-spy); NotRunnableError where it runs no attempt."""
        runner = self.runners.get(job.id)
        if runner is None or runner.attempt is None or job.state.final:
            raise NotRunnableError(f"job {job.id} is {job.state.value}, not running")
        return await runner.attempt.stacks(rank, native)

    async def release_gpu(self, name: str, uid: int) -> Quarantined:
        """Lift a GPU's quarantine (NotFoundError: no such GPU, or not quarantined)."""
        record = await self.health.release(name, uid)
        self.scheduler.wake()  # a released GPU may let queued jobs start
        return record

    def share_table(self) -> tuple[list[ShareView], float]:
        """Each user's usage and fair-share factor (queue.fairshare), and the half-life of usage."""
        usage = self.share.now(self.clock())
        views = share_views(usage, self.scheduler.fair_factors(frozenset(usage)), self.table.unended.values(),
                            self.runners.ids())
        return views, self.share.half_life
