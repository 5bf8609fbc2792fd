"""The scheduler's decisions, as pure functions of the queue, the running set, each user's usage and the clock.

`order`: queued jobs in the order they may start: priority, then the owner's fair-share factor
(Slurm's 2^(-U/S): U the owner's share of all recent usage, S an equal share of the users with jobs
queued or running), then submission. `plan` walks that order: a job starts, or waits with its
reason; one that waits for resources stops every job behind it (the head of the order is never
overtaken), one held by its owner's limit or its dependencies does not. A job that waits for
resources may preempt (`Preempt`): the fewest preemptible running jobs of lower priority, each
past its minimum run time, whose resources let it start (`victims`).

Nothing here does I/O, reads a clock or changes what it is given: the capacity is copied before
anything is taken from it, and the scheduler applies the decisions (`Scheduler._admit`).
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Protocol

from ...protocol import JobSpec
from ...protocol.spec import dependency_ids, is_multinode
from ..config import Config
from ..store.records import Job
from .admission import over_user_gpus

MAX_CANDIDATES = 10  # running jobs weighed as victims of one preemption (combinations of at most these)


class Capacity(Protocol):
    """What `plan` needs of `Resources` (it works on a copy)."""

    def take(self, spec: JobSpec) -> list[str] | None: ...
    def give_back(self, spec: JobSpec, gpus: list[str], job_id: str | None = None) -> None: ...
    def shortfall(self, spec: JobSpec) -> str: ...


@dataclass(frozen=True)
class Running:
    """A running job and since when (wall clock) its current attempt holds its resources."""

    job: Job
    since: float


@dataclass(frozen=True)
class Start:
    job: Job
    gpus: list[str]


@dataclass(frozen=True)
class Wait:
    job: Job
    reason: str


@dataclass(frozen=True)
class Preempt:
    """`job` waits for resources; stopping `victims` (gracefully, then requeued) frees them."""

    job: Job
    victims: tuple[Job, ...]
    reason: str


Decision = Start | Wait | Preempt


def factors(usage: Mapping[int, float], users: Set[int]) -> dict[int, float]:
    """Each user's fair-share factor (1: has used nothing lately; towards 0: has used far more than
    an equal share); users in `usage` but not in `users` count towards the total, not the shares."""
    total = sum(usage.values())
    share = 1 / max(1, len(users))
    if total <= 0:
        return dict.fromkeys(users, 1.0)
    return {uid: 2.0 ** (-(usage.get(uid, 0.0) / total) / share) for uid in users}


def order(queue: Sequence[Job], fair: Mapping[int, float]) -> list[Job]:
    """Priority first, then the owner's fair-share factor (higher first), then submission."""
    return sorted(queue, key=lambda j: (-j.spec.priority, -fair.get(j.owner_uid, 1.0), j.seq))


def preemptible(spec: JobSpec, config: Config) -> bool:
    """Whether a job may be preempted: it asked (--preemptible), or the policy's priority band says so,
    which takes a script (that may not honour the stop API) only where `preempt_scripts` is set. A
    multi-node job never is: its other nodes would re-form or fail without it."""
    if is_multinode(spec):
        return False
    if spec.preemptible:
        return True
    below = config.preemptible_below
    if below is None or spec.priority >= below:
        return False
    return spec.script is None or config.preempt_scripts


def victims(job: Job, running: Sequence[Running], capacity: Capacity, now: float, config: Config,
            stopping: Set[str]) -> tuple[Job, ...] | None:
    """The fewest running jobs to preempt so that `job` fits (lowest priority, then the most recently
    started, first among equals), or None where no such set exists."""
    cands = sorted((r for r in running if r.job.id not in stopping and r.job.spec.priority < job.spec.priority
                    and preemptible(r.job.spec, config) and now - r.since >= config.preempt_min_run),
                   key=lambda r: (r.job.spec.priority, -r.since))[:MAX_CANDIDATES]
    if not _frees(capacity, cands, job):  # not even all of them: no search (this runs at every wake)
        return None
    for k in range(1, len(cands) + 1):
        for combo in itertools.combinations(cands, k):
            if _frees(capacity, combo, job):
                return tuple(r.job for r in combo)
    return None  # pragma: no cover (all of them free enough)


def _frees(capacity: Capacity, combo: Sequence[Running], job: Job) -> bool:
    """Whether `job` would fit once the jobs of `combo` gave their resources back (on a copy)."""
    trial = copy.deepcopy(capacity)
    for r in combo:
        trial.give_back(r.job.spec, r.job.gpus)
    return trial.take(job.spec) is not None


def plan(queue: Sequence[Job], blocked: Set[str], running: Sequence[Running], usage: Mapping[int, float],
         now: float, capacity: Capacity, config: Config, stopping: Set[str] = frozenset()) -> list[Decision]:
    """What each queued job does now, in `order`; `stopping`: running jobs already being preempted."""
    free = copy.deepcopy(capacity)
    fair = factors(usage, {j.owner_uid for j in queue} | {r.job.owner_uid for r in running})
    held = [r.job for r in running]
    started = len(running)
    head: Job | None = None  # the first job that waits for resources: none behind it may start
    stop: str | None = None  # why no job further down the order may start (a limit)
    out: list[Decision] = []
    for job in order(queue, fair):
        if job.id in blocked:
            out.append(Wait(job, "dependency: waiting for " + ", ".join(job.waiting_on or dependency_ids(job.spec))))
        elif head is not None:
            out.append(Wait(job, _behind(head, job, fair)))
        elif stop is not None:
            out.append(Wait(job, stop))
        elif started >= config.max_running:
            stop = f"limit: {started} jobs running (max_running)"
            out.append(Wait(job, stop))
        elif over_user_gpus(config, held, job):  # its owner's limit: others may pass
            out.append(Wait(job, f"user limit: its owner holds the GPUs one user may (max_gpus_per_user "
                                 f"{config.max_gpus_per_user})"))
        elif (gpus := free.take(job.spec)) is None:
            out.append(_no_room(job, free, running, now, config, stopping))
            head = job
        else:
            out.append(Start(job, gpus))
            held.append(job)
            started += 1
    return out


def _no_room(job: Job, free: Capacity, running: Sequence[Running], now: float, config: Config,
             stopping: Set[str]) -> Wait | Preempt:
    reason = f"resources: {free.shortfall(job.spec)}"
    if any(r.job.id in stopping for r in running):
        return Wait(job, reason + f"; preempted jobs are checkpointing ({', '.join(sorted(stopping))})")
    chosen = victims(job, running, free, now, config, stopping)
    if chosen is None:
        return Wait(job, reason)
    return Preempt(job, chosen, reason + f"; preempting {', '.join(v.id for v in chosen)}")


def _behind(head: Job, job: Job, fair: Mapping[int, float]) -> str:
    """Why `job` waits behind `head`, which waits for resources: its place in line, or fair share."""
    mine, theirs = fair.get(job.owner_uid, 1.0), fair.get(head.owner_uid, 1.0)
    if head.spec.priority == job.spec.priority and mine < theirs:
        return (f"fair share: behind {head.id}, which waits for resources (uid {job.owner_uid} has used more "
                f"lately: factor {mine:.2f}, uid {head.owner_uid} {theirs:.2f})")
    return f"priority: behind {head.id}, which waits for resources"
