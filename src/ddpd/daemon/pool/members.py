"""What the pool holds: a `PoolWorker` (a pooled interpreter, a fork server, or a worker one
forked), a fork server as ``ddpctl daemon`` shows it (`ServerSnapshot`), and the kind of helper
process its interpreters are (`POOL`: their cgroups' end and the sweep of those a killed daemon
left behind, `ddpd.daemon.contain.helpers`)."""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass, field

import anyio

from ...protocol.channel import Hello
from ..contain.cgroups import Cgroup
from ..contain.helpers import HelperKind
from .channel import WorkerChannel
from .poolkeys import Demand, PoolKey


class ForkServer:
    """What the daemon keeps of a fork server: one request at a time, what it served, and the end of
    its start (`settled`: ready, failed or retired) that a job's first rank may wait for."""

    def __init__(self) -> None:
        self.lock = anyio.Lock()
        self.forks = 0  # workers forked and adopted
        self.settled = anyio.Event()
        self.awaited = False  # a job's rank waits for its start: normal priority, as that job's ranks'


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


@dataclass(frozen=True)
class ServerSnapshot:
    """A fork server at one moment (`WarmPool.servers`): its key and the interpreter it was learned from,
    its pid, whether it is ready, the workers it forked, its spares' pids, when its key was last used
    (monotonic; None: being forgotten)."""

    key: PoolKey
    python: str
    pid: int
    ready: bool
    forks: int
    spares: tuple[int, ...]
    last_used: float | None

    @classmethod
    def of(cls, w: PoolWorker, demand: Demand | None, spares: tuple[int, ...]) -> ServerSnapshot:
        """`w` (a fork server), its key's `demand` (None: being forgotten) and its spares' pids."""
        assert w.server is not None
        return cls(w.key, demand.shape.argv[0] if demand else w.key.interpreter[1], w.pid, w.hello is not None,
                   w.server.forks, spares, demand.last_used if demand else None)


# a pool interpreter's cgroup (``pool-<n>``): its end kills whatever the interpreter left in it (a
# forked escapee included); the sweep ends those a killed daemon left behind
POOL = HelperKind("pool", prefix="pool-", kill_wait=5.0)
