"""Dependencies between jobs (`--after`, Slurm's afterok): a queued job starts only once every job it
names has SUCCEEDED, and fails without running ("dependency j3-ab12 FAILED") as soon as one of them
ends otherwise or no longer exists.

At submit the ids are resolved (prefixes included) to full ids, once, and stored in the spec, so a
restarted daemon reads the same dependencies. `verdict` is the decision, pure; the scheduler looks
the states up (`states_of`) each time its queue is looked at, and acts on the verdict.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

import msgspec

from ...protocol import JobSpec, JobState, SpecError
from ..store.errors import DaemonError
from ..store.records import Job
from .jobids import resolve
from .table import JobTable


@dataclass(frozen=True)
class Ready:
    pass


@dataclass(frozen=True)
class Waiting:
    on: list[str]  # the dependencies not yet ended, in the order given


@dataclass(frozen=True)
class Broken:
    reason: str  # why the job can never start, naming the dependency


Verdict = Ready | Waiting | Broken


def verdict(states: Mapping[str, JobState | None]) -> Verdict:
    """`states`: each dependency's state in the order given (None: the job no longer exists)."""
    waiting = []
    for job_id, state in states.items():
        if state is None:
            return Broken(f"dependency {job_id} no longer exists")
        if state.final and state is not JobState.SUCCEEDED:
            return Broken(f"dependency {job_id} {state.value}")
        if not state.final:
            waiting.append(job_id)
    return Waiting(waiting) if waiting else Ready()


async def states_of(ids: list[str], lookup: Callable[[str], Awaitable[Job | None]]) -> dict[str, JobState | None]:
    states: dict[str, JobState | None] = {}
    for job_id in ids:
        job = await lookup(job_id)
        states[job_id] = None if job is None else job.state
    return states


async def resolve_after(spec: JobSpec, table: JobTable) -> JobSpec:
    """The spec with its dependencies as full ids, each once; SpecError `after[i]` for an unknown or
    ambiguous one, and for one that already ended otherwise than SUCCEEDED (the job could never run:
    refused here rather than accepted and failed at once)."""
    if not spec.after:
        return spec
    resolved: list[str] = []
    for i, text in enumerate(spec.after):
        try:
            job = await resolve(table, text)
        except DaemonError as exc:
            raise SpecError(f"after[{i}]", exc.message) from None
        if job.state.final and job.state is not JobState.SUCCEEDED:
            raise SpecError(f"after[{i}]", f"job {job.id} already ended {job.state.value}; a job after it "
                                           "could never start")
        if job.id not in resolved:
            resolved.append(job.id)
    return msgspec.structs.replace(spec, after=resolved)
