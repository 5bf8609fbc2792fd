"""What the pool holds: a `PoolWorker` (a pooled interpreter, a fork server, or a worker one
forked), and the pool cgroups' end (`end_cgroup`: whatever an interpreter left in its cgroup) and
sweep (`sweep_cgroups`: those a killed daemon left behind)."""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import structlog

from ...protocol.channel import Hello
from ..contain.cgroups import Cgroup
from .channel import WorkerChannel
from .poolkeys import PoolKey

log = structlog.get_logger("ddpd")


class ForkServer:
    """What the daemon keeps of a fork server: one request at a time, and what it served."""

    def __init__(self) -> None:
        self.lock = anyio.Lock()
        self.forks = 0  # workers forked and adopted


@dataclass(eq=False)
class PoolWorker:
    proc: subprocess.Popen[bytes]
    channel: WorkerChannel
    key: PoolKey
    env: dict[str, str]  # what it was started with (an assignment brings the difference)
    cgroup: Cgroup | None = None  # its own, until an attempt takes it over
    spawned_at: float = field(default_factory=time.monotonic)
    hello: Hello | None = None
    taken: bool = False
    retired: bool = False  # ended by the plan (not a death to report)
    held: bool = False  # its cgroup frozen: a refill waiting for a core no job's rank holds
    server: ForkServer | None = None  # a fork server's (`pool_fork_server`): it forks the key's workers
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)

    @property
    def pid(self) -> int:
        return self.proc.pid


CGROUP_WAIT = 5.0  # seconds for a pool worker's cgroup to empty after cgroup.kill


def end_cgroup(cgroup: Cgroup) -> None:
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
            end_cgroup(Cgroup(path))
