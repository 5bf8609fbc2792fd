"""The jobs the daemon holds in memory, and the way to the rest of its history.

Every unended job is held, and the `HISTORY_IN_MEMORY` most recent ended ones; older ended jobs live
only in the journal and are read when asked for (`lookup`, `page`, `by_key`), so a long history costs
start-up time and memory only in proportion to that bound. Counts by state cover the whole record.
"""

from __future__ import annotations

from collections import Counter, deque

from ...protocol import JobState
from ..store.journal import Journal
from ..store.records import Job

HISTORY_IN_MEMORY = 1000  # ended jobs held in memory (the most recent)


class JobTable:
    def __init__(self, journal: Journal, history: int = HISTORY_IN_MEMORY) -> None:
        self.journal = journal
        self.history = history
        self.jobs: dict[str, Job] = {}
        self.unended: dict[str, Job] = {}  # not in a final state: what the queue loop looks at
        self.keys: dict[tuple[int, str], str] = {}  # (owner, idempotency key) -> id, for jobs held
        self._ended_ids: deque[str] = deque()  # ended jobs held, oldest first
        self.ended_counts: Counter[JobState] = Counter()  # ended jobs on record, by final state
        self._max_seq = 0

    def next_seq(self) -> int:
        """A new job's number, taken now (concurrent submits get different ones)."""
        self._max_seq += 1
        return self._max_seq

    def add(self, job: Job) -> None:
        """A job saved (submitted now, or loaded at recovery)."""
        self.jobs[job.id] = job
        self._max_seq = max(self._max_seq, job.seq)
        if job.idempotency_key is not None:
            self.keys[(job.owner_uid, job.idempotency_key)] = job.id
        if job.state.final:
            self._ended_ids.append(job.id)
        else:
            self.unended[job.id] = job

    async def load(self) -> None:
        """Recovery: the counts of the whole record, then the jobs to hold."""
        self.ended_counts.update(await self.journal.ended_counts())
        for job in await self.journal.load_jobs(recent_ended=self.history):
            self.add(job)
        self._trim()

    def ended(self, job: Job) -> None:
        """A held job reached its final state."""
        self.unended.pop(job.id, None)
        self.ended_counts[job.state] += 1
        self._ended_ids.append(job.id)
        self._trim()

    def forget(self, job: Job, *, deleted: bool = False) -> None:
        """Let go of a job (it stays on record unless `deleted`)."""
        self.jobs.pop(job.id, None)
        self.unended.pop(job.id, None)
        if job.idempotency_key is not None:
            self.keys.pop((job.owner_uid, job.idempotency_key), None)
        if deleted and job.state.final:
            self.ended_counts[job.state] -= 1

    def _trim(self) -> None:
        while len(self._ended_ids) > self.history:
            old = self.jobs.get(self._ended_ids.popleft())
            if old is not None and old.state.final:
                self.forget(old)

    async def lookup(self, job_id: str) -> Job | None:
        """A job by id: the held object, else a copy read from the journal (None: no such job)."""
        job = self.jobs.get(job_id)
        return job if job is not None else await self.journal.load_job(job_id)

    async def by_key(self, owner_uid: int, key: str) -> Job | None:
        job_id = self.keys.get((owner_uid, key)) or await self.journal.job_by_key(owner_uid, key)
        return None if job_id is None else await self.lookup(job_id)

    async def page(self, limit: int, before: int | None = None, *, owner_uid: int | None = None,
                   active: bool = False) -> list[Job]:
        """Up to `limit` jobs with seq below `before`, newest first (the held object where there is one)."""
        jobs = await self.journal.list_jobs_page(limit, before, owner_uid=owner_uid, active=active)
        return [self.jobs.get(j.id, j) for j in jobs]

    def state_counts(self) -> dict[JobState, int]:
        """Jobs on record by state."""
        counts = dict.fromkeys(JobState, 0)
        counts.update(self.ended_counts)
        for job in self.unended.values():
            if not job.state.final:
                counts[job.state] += 1
        return counts

    def queued(self) -> list[Job]:
        """Queued jobs in the order they start: priority first, then submission."""
        return sorted((j for j in self.unended.values() if j.state is JobState.QUEUED),
                      key=lambda j: (-j.spec.priority, j.seq))
