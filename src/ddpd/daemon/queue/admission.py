"""Admission of a submitted job: the spec's checks against this daemon, its owner's grants, and the
queue limits.

Everything here raises before anything is saved: SpecError naming the field, or LimitError.

What depends on the owner is checked as the owner: a priority above `priority_ceiling` needs the
operator's grant (`priority_ceiling_of`), and the spec's paths are looked at by a helper running as
the submitter (`PathChecks`, contain.pathcheck), never by root: a refusal says only what the
submitter could have seen itself. Both are blocking NSS or process work, run off the event loop;
path checks are bounded in time, and each uid runs at most PATH_CHECKS_PER_USER at once (its others
wait their turn, holding no other user's slot).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import anyio
import anyio.to_thread

from ...protocol import JobSpec, JobState, SpecError, check_spec
from ..config import Config
from ..contain.identity import Identity, UnknownUser, admin_gid
from ..contain.pathcheck import check_paths_as
from ..contain.userslots import UserSlots
from ..store.errors import ForbiddenError, LimitError
from ..store.records import Job
from .resources import Resources

MAX_KEY = 200  # characters of an idempotency key
PATH_CHECK_TIMEOUT = 5.0  # seconds the submitter's helper may take to look at the spec's paths
PATH_CHECKS_PER_USER = 2  # of those helpers one uid may run at once
MAX_PATH_CHECKS = 16  # all users together (worker threads of their own limiter)


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


def priority_ceiling_of(uid: int, config: Config) -> int | None:
    """The highest priority `uid` may ask for: the greatest of `priority_ceiling`, the user's entry in
    `user_priority_ceilings` and its groups' in `group_priority_ceilings`; None for root, the daemon's
    own user and members of `admin_group` (bounded by `priority_range` alone). Blocking (NSS)."""
    if uid in (0, os.geteuid()):
        return None
    try:
        identity = Identity.of(uid)
    except UnknownUser:
        return config.priority_ceiling
    admin = admin_gid(config.admin_group)
    if admin is not None and admin in identity.groups:
        return None
    granted = [config.priority_ceiling, config.user_priority_ceilings.get(identity.name, 0)]
    if config.group_priority_ceilings:
        granted += [config.group_priority_ceilings.get(name, 0) for name in identity.group_names()]
    return max(granted)


async def check_priority(spec: JobSpec, config: Config, uid: int) -> None:
    """SpecError naming the ceiling when `spec` asks for more priority than its owner was granted."""
    if spec.priority <= config.priority_ceiling:  # what everyone may ask for: no lookup
        return
    ceiling = await anyio.to_thread.run_sync(priority_ceiling_of, uid, config)
    if ceiling is not None and spec.priority > ceiling:
        raise SpecError("priority", f"{spec.priority} is above {ceiling}, the highest priority uid {uid} may ask "
                                    "for: priority above the default is the operator's to grant "
                                    "(priority_ceiling, user_priority_ceilings, group_priority_ceilings)")


class PathChecks:
    """The spec's paths looked at as its submitter (contain.pathcheck), bounded, a share per uid."""

    def __init__(self, timeout: float = PATH_CHECK_TIMEOUT) -> None:
        self.timeout = timeout
        self._slots = UserSlots(lambda: PATH_CHECKS_PER_USER)
        self._limiter: anyio.CapacityLimiter | None = None

    async def check(self, spec: JobSpec, uid: int) -> None:
        """SpecError (`workdir` or `script`) where the submitter cannot enter the working directory or
        read the script; ForbiddenError for a uid with no passwd entry."""
        script = spec.script[0] if spec.script is not None and not spec.module else None
        if script is not None and not script.startswith("/") and spec.workdir is None:
            raise SpecError("script", f"relative script path {script!r} needs a workdir")
        if spec.workdir is None and script is None:
            return
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(MAX_PATH_CHECKS)
        try:
            identity = await anyio.to_thread.run_sync(Identity.of, uid)
        except UnknownUser as exc:
            raise ForbiddenError(str(exc)) from None
        async with self._slots.slot(uid):
            problem = await anyio.to_thread.run_sync(check_paths_as, identity, spec.workdir, script, self.timeout,
                                                     limiter=self._limiter)
        if problem is not None:
            raise SpecError(problem.field, problem.message)


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
