"""The started jobs: one `JobRunner` each, from the scheduler's start of the job until its runner ended.

A job is running (it holds its resources) while its runner is here. Commands reach a job's runner
through `send` (dropped, with the event set, where the job has none: it is queued or ended).
"""

from __future__ import annotations

import anyio

from ..store.records import Job
from .commands import Command
from .runner import JobRunner
from .table import JobTable


class Runners:
    def __init__(self, table: JobTable) -> None:
        self._table = table
        self._runners: dict[str, JobRunner] = {}
        self._idle = anyio.Event()
        self._idle.set()

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._runners

    def __len__(self) -> int:
        return len(self._runners)

    def ids(self) -> frozenset[str]:
        return frozenset(self._runners)

    def get(self, job_id: str) -> JobRunner | None:
        return self._runners.get(job_id)

    def add(self, runner: JobRunner) -> None:
        self._runners[runner.job.id] = runner
        if self._idle.is_set():
            self._idle = anyio.Event()

    def remove(self, job_id: str) -> None:
        self._runners.pop(job_id, None)
        if not self._runners:
            self._idle.set()

    def running_jobs(self) -> list[Job]:
        """The started jobs not yet ended (they hold their resources), in the table's order."""
        return [j for j in self._table.unended.values() if j.id in self._runners]

    def send(self, job_id: str, command: Command) -> anyio.Event:
        """`command` to the job's runner; the event is set once applied (at once: the job has no runner)."""
        runner = self._runners.get(job_id)
        if runner is None:
            done = anyio.Event()
            done.set()
            return done
        return runner.send(command)

    async def tell_all(self, command: Command) -> None:
        """`command` to every runner, returning once each applied it."""
        for done in [r.send(command) for r in list(self._runners.values())]:
            await done.wait()

    async def idle(self) -> None:
        """Return once no job is running."""
        while self._runners:
            await self._idle.wait()
