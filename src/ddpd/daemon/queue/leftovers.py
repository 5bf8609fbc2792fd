"""What a killed daemon's attempts left behind, found at the next start and killed (blocking: call
from a thread): everything in an attempt's cgroup, and every process carrying an attempt's marker."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import structlog

from ..attempt.teardown import UNKILLABLE_WAIT
from ..contain.cgroups import Cgroup
from ..contain.procs import find_members, proc_environ_has, reap_children

log = structlog.get_logger("ddpd")


def kill_cgroup(path: str) -> list[int]:
    """Blocking: SIGKILL every process left in an attempt's cgroup (cgroup.kill), then remove it."""
    cg = Cgroup(Path(path))
    try:
        if not cg.path.exists():
            return []
        pids = cg.pids()
        if cg.kill(UNKILLABLE_WAIT):
            cg.remove()
        else:
            log.warning("cgroup.not_emptied", cgroup=path, pids=cg.pids())
    except OSError as exc:
        log.warning("cgroup.recovery_failed", cgroup=path, error=str(exc))
        return []
    reap_children(pids)
    return pids


def kill_marked(marker: bytes) -> list[int]:
    """SIGKILL every process carrying the attempt's marker, each checked against /proc just before."""
    killed = []
    for p in find_members(None, marker):
        if proc_environ_has(p.pid, marker):
            try:
                os.kill(p.pid, signal.SIGKILL)
                killed.append(p.pid)
            except ProcessLookupError:
                pass
    return killed

