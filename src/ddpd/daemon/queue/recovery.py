"""What a daemon restart finds: the jobs that were starting or running when it stopped.

Each lost its attempt: what is left of it is killed (its cgroup first, which misses nothing, then by
its marker), and the job is queued again while it has a restart left (the lost attempt counts as
one) or FAILED (`run.lifecycle.after_daemon_restart`). Queued and ended jobs stay as they are.
"""

from __future__ import annotations

from collections.abc import Iterable

import anyio
import anyio.to_thread

from ...protocol import JobState
from ...protocol.control import RootCause
from ...protocol.worker import marker_entry
from ..run import lifecycle
from ..store.journal import Journal
from ..store.records import Job
from .ends import JobEnds
from .leftovers import kill_cgroup, kill_marked


async def recover_jobs(jobs: Iterable[Job], journal: Journal, ends: JobEnds) -> None:
    """Requeue or fail every job of `jobs` that was running, its leftovers killed."""
    for job in list(jobs):
        new = lifecycle.after_daemon_restart(job.state, attempt=job.attempt, max_restarts=job.spec.max_restarts)
        if new is None:
            continue
        killed = await kill_attempt_leftovers(job, journal)
        if new is JobState.FAILED:
            job.root_cause = RootCause(reason="daemon_restart", attempt=job.attempt,
                                       detail="the daemon stopped while the job was running")
        await journal.job_state(job, new, "daemon_restart", finish=False, killed=killed)
        if new.final:
            await ends.ended(job)


async def kill_attempt_leftovers(job: Job, journal: Journal) -> list[int]:
    """Kill what is left of the job's last attempt; the pids killed (``job.leftover_killed``)."""
    killed: list[int] = []
    for path in await journal.attempt_cgroups(job.id, job.attempt):  # the cgroup first: it misses nothing
        killed += await anyio.to_thread.run_sync(kill_cgroup, path)
    for token in await journal.attempt_tokens(job.id, job.attempt):
        marker = marker_entry(job.id, job.attempt, token)
        killed += await anyio.to_thread.run_sync(kill_marked, marker)
    if killed:
        await journal.event(job, "job.leftover_killed", pids=killed, reason="daemon_restart")
    return killed
