"""A job's memory and CPU limits (`--mem`, `--cpus`) on its attempt's cgroup, or why they are not applied.

Where the daemon's cgroup subtree has the controller (`Subtree.controllers`), the limit is written
to the attempt's cgroup (`memory.max`, `cpu.max`) before any rank starts. Where it has not, or
where there is no cgroup at all, the limit is reported as unavailable with the reason (the
`job.limits` event) and the job runs without it: ddpd never fakes a limit. cgroup v1 hierarchies
are not used (a host that mounts memory or cpu as v1 only, with an empty v2 hierarchy, reports
them unavailable).

`apply_limits` writes files: call it via anyio.to_thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...protocol import JobSpec
from .cgroups import Cgroup, Subtree


@dataclass(frozen=True)
class LimitsOutcome:
    applied: dict[str, str] = field(default_factory=dict)  # cgroup file -> value written
    unavailable: dict[str, str] = field(default_factory=dict)  # controller -> why not


def wanted(spec: JobSpec) -> dict[str, str]:
    """Controller -> the spec field asking for it."""
    return {**({"memory": "memory"} if spec.memory is not None else {}),
            **({"cpu": "cpus"} if spec.cpus is not None else {})}


def apply_limits(spec: JobSpec, cgroup: Cgroup | None, subtree: Subtree | None,
                 no_cgroup: str = "this daemon contains jobs by process group only (no cgroup v2)") -> LimitsOutcome:
    """Apply the spec's limits to `cgroup` where `subtree` has their controllers; say why not elsewhere."""
    asked = wanted(spec)
    if not asked:
        return LimitsOutcome()
    if cgroup is None or subtree is None:
        return LimitsOutcome(unavailable={c: f"{no_cgroup}; limit not applied" for c in asked})
    unavailable = {c: f"{subtree.unavailable.get(c, f'controller {c} is not enabled for jobs')}; limit not applied"
                   for c in asked if c not in subtree.controllers}
    report = cgroup.set_limits(
        memory_bytes=spec.memory if "memory" in asked and "memory" not in unavailable else None,
        cpus=spec.cpus if "cpu" in asked and "cpu" not in unavailable else None)
    return LimitsOutcome(applied=report.applied, unavailable={**unavailable, **report.unavailable})
