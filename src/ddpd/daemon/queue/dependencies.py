"""Dependencies between jobs, Slurm's three kinds: `after` (afterok: every job it names has
SUCCEEDED), `after_any` (afterany: they ended, however) and `after_notok` (afternotok: they ended
otherwise than SUCCEEDED). A queued job starts once every dependency is met, and fails without
running ("dependency j3-ab12 FAILED") as soon as one can no longer be, or no longer exists.

At submit the ids are resolved (prefixes included) to full ids, once, and stored in the spec, so a
restarted daemon reads the same dependencies; one that already ended so that it can never be met
is refused there. `verdict` is the decision, pure; the scheduler looks the states up
(`states_of`) each time its queue is looked at, and acts on the verdict.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Literal

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


Kind = Literal["ok", "any", "notok"]
KIND_FIELDS: dict[Kind, str] = {"ok": "after", "any": "after_any", "notok": "after_notok"}


def kinds_of(spec: JobSpec) -> dict[str, Kind]:
    """Each dependency of the spec and its kind."""
    kinds: dict[str, Kind] = {}
    for kind, field in KIND_FIELDS.items():
        for job_id in getattr(spec, field):
            kinds.setdefault(job_id, kind)
    return kinds


def unmet(state: JobState, kind: Kind) -> str | None:
    """Why an ended dependency of this kind can never be met (None: it is met)."""
    if kind == "ok" and state is not JobState.SUCCEEDED:
        return state.value
    if kind == "notok" and state is JobState.SUCCEEDED:
        return f"{state.value} (the job runs only after a failure: --after-notok)"
    return None


def verdict(states: Mapping[str, JobState | None], kinds: Mapping[str, Kind] | None = None) -> Verdict:
    """`states`: each dependency's state in the order given (None: the job no longer exists);
    `kinds`: each one's kind (default: ok)."""
    waiting = []
    for job_id, state in states.items():
        if state is None:
            return Broken(f"dependency {job_id} no longer exists")
        if not state.final:
            waiting.append(job_id)
            continue
        why = unmet(state, (kinds or {}).get(job_id, "ok"))
        if why is not None:
            return Broken(f"dependency {job_id} {why}")
    return Waiting(waiting) if waiting else Ready()


async def states_of(ids: list[str], lookup: Callable[[str], Awaitable[Job | None]]) -> dict[str, JobState | None]:
    states: dict[str, JobState | None] = {}
    for job_id in ids:
        job = await lookup(job_id)
        states[job_id] = None if job is None else job.state
    return states


async def resolve_after(spec: JobSpec, table: JobTable) -> JobSpec:
    """The spec with its dependencies as full ids, each once; SpecError `after[i]` (`after_any[i]`,
    `after_notok[i]`) for an unknown or ambiguous one, and for one that already ended so that it can
    never be met (the job could never run: refused here rather than accepted and failed at once)."""
    if not (spec.after or spec.after_any or spec.after_notok):
        return spec
    seen: set[str] = set()
    lists: dict[str, list[str]] = {}
    for kind, field in KIND_FIELDS.items():
        lists[field] = []
        for i, text in enumerate(getattr(spec, field)):
            job = await _resolved(table, f"{field}[{i}]", text, kind)
            if job.id not in seen:
                seen.add(job.id)
                lists[field].append(job.id)
    return msgspec.structs.replace(spec, **lists)


async def _resolved(table: JobTable, where: str, text: str, kind: Kind) -> Job:
    try:
        job = await resolve(table, text)
    except DaemonError as exc:
        raise SpecError(where, exc.message) from None
    why = unmet(job.state, kind) if job.state.final else None
    if why is not None:
        raise SpecError(where, f"job {job.id} already ended {why}; a job after it could never start")
    return job
