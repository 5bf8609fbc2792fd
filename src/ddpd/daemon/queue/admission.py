"""Admission of a submitted job: the spec's checks against this daemon, and the queue limits.

Everything here raises before anything is saved: SpecError naming the field, or LimitError.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import anyio.to_thread

from ...protocol import JobSpec, JobState, SpecError, check_spec
from ..config import Config
from ..store.errors import LimitError
from ..store.records import Job
from .resources import Resources

MAX_KEY = 200  # characters of an idempotency key


def check_key(key: str) -> str:
    if not 0 < len(key) <= MAX_KEY or not key.isprintable():
        raise SpecError("idempotency_key", f"must be 1 to {MAX_KEY} printable characters")
    return key


def check_bounds(spec: JobSpec, config: Config) -> None:
    """The daemon's configured bands: priority, and a kill grace the service's stop timeout allows."""
    lo, hi = config.priority_range
    if not lo <= spec.priority <= hi:
        raise SpecError("priority", f"{spec.priority} is outside the daemon's range {lo}..{hi}")
    grace = spec.timeouts.kill_grace
    if grace is not None and grace > config.max_kill_grace:
        raise SpecError("timeouts.kill_grace", f"{grace} s is more than the daemon's maximum "
                                               f"{config.max_kill_grace} s")


async def admit(spec: JobSpec, config: Config, resources: Resources) -> JobSpec:
    """The checked spec (task filled in), or SpecError naming what cannot run here."""
    spec = check_spec(spec)
    check_bounds(spec, config)
    await anyio.to_thread.run_sync(check_paths, spec)
    if spec.device == "cuda" and resources.total_gpus == 0:
        raise SpecError("device", "cuda was asked for but the daemon has no GPUs")
    if spec.backend == "nccl" and resources.total_gpus == 0:
        raise SpecError("backend", "nccl needs GPUs but the daemon has none; use gloo")
    limit = config.max_gpus_per_user
    gpus, _ = resources.need(spec)
    if limit is not None and gpus > limit:
        raise SpecError("gpus_per_rank", f"can never run here: the job needs {gpus:g} GPUs and one user may hold "
                                         f"{limit} at once (max_gpus_per_user)")
    problem = resources.can_ever_fit(spec)
    if problem:
        raise SpecError("nproc" if "CPU" in problem else "gpus_per_rank", f"can never run here: {problem}")
    return spec


def check_limits(config: Config, unended: Iterable[Job], owner_uid: int) -> None:
    """LimitError when the queue is full, for this user or for all."""
    queued = [j.owner_uid for j in unended if j.state is JobState.QUEUED]
    if len(queued) >= config.max_queued:
        raise LimitError(f"the queue is full ({config.max_queued} jobs queued, max_queued); retry later")
    mine = queued.count(owner_uid)
    if mine >= config.max_queued_per_user:
        raise LimitError(f"uid {owner_uid} has {mine} jobs queued, the most one user may "
                         f"(max_queued_per_user); retry later")


def over_user_gpus(config: Config, running: Iterable[Job], job: Job) -> bool:
    """Whether starting `job` now would take its owner past max_gpus_per_user (it waits, and jobs
    of other users behind it may start: one user at their limit does not hold up everyone)."""
    limit = config.max_gpus_per_user
    if limit is None:
        return False
    wanted, _ = Resources.need(job.spec)
    if wanted == 0:
        return False
    held = sum(Resources.need(j.spec)[0] for j in running if j.owner_uid == job.owner_uid)
    return held + wanted > limit


def check_paths(spec: JobSpec) -> None:
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
