"""A job's end: what follows once a job reached its final state, whoever ended it.

The summary event (``job.finished``), the job's place in the retention heap and its owner's history
bound, its ``ended`` notice, and `Job.finished` set last: a `wait` returns once every event of the
job is out. The runner ends the jobs it ran; the scheduler ends queued ones (cancelled, a dependency
failed); recovery ends those a daemon restart left without restarts.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import structlog

from ...protocol import JobState
from ...protocol.control import RootCause
from ..store.journal import Journal
from ..store.records import Job
from .notifyhooks import JobHooks
from .retention import Retention
from .table import JobTable

log = structlog.get_logger("ddpd")


class JobEnds:
    def __init__(self, journal: Journal, table: JobTable, retention: Retention, hooks: JobHooks,
                 clock: Callable[[], float] = time.time) -> None:
        self.journal = journal
        self.table = table
        self.retention = retention
        self.hooks = hooks
        self.clock = clock

    async def ended(self, job: Job) -> None:
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
            self.hooks.post(job, "ended")
            await self.journal.count_stored(job.id)  # what its record takes: its owner's history bound counts it
        finally:
            job.finished.set()  # after the summary event: a `wait` returns once every event of the job is out
        self.retention.ended(job.owner_uid)  # its owner's history, against its bounds

    async def fail_internal(self, job: Job, exc: Exception) -> None:
        """A bug in the job's supervision: FAILED (internal_error); never raises, the job ends FAILED in
        memory even when nothing can be written."""
        if job.state.final:
            return
        job.root_cause = RootCause(reason="internal_error", attempt=job.attempt, detail=repr(exc))
        try:
            await self.journal.job_state(job, JobState.FAILED, "internal_error", finish=False)
            await self.ended(job)
        except Exception:
            log.exception("job.internal_error_unrecorded", job_id=job.id)
            job.state, job.reason, job.finished_at = JobState.FAILED, "internal_error", self.clock()
            job.finished.set()
