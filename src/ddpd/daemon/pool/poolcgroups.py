"""The cgroups of pool interpreters: ending one (whatever its interpreter left in it) and sweeping
those a killed daemon left behind."""

from __future__ import annotations

from pathlib import Path

import structlog

from ..contain.cgroups import AttemptCgroup

log = structlog.get_logger("ddpd")

CGROUP_WAIT = 5.0  # seconds for a pool worker's cgroup to empty after cgroup.kill


def end_cgroup(cgroup: AttemptCgroup) -> None:
    """Kill whatever a pool worker left in its cgroup (a forked escapee included) and remove it."""
    try:
        if cgroup.kill(CGROUP_WAIT):
            cgroup.remove()
        else:
            log.warning("pool.cgroup_busy", cgroup=str(cgroup.path), pids=cgroup.pids())
    except OSError as exc:
        log.warning("pool.cgroup_failed", cgroup=str(cgroup.path), error=str(exc))


def sweep_cgroups(jobs: Path) -> None:
    for path in jobs.glob("pool-*"):
        if path.is_dir():
            end_cgroup(AttemptCgroup(path))
