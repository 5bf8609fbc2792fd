"""What the pool holds: a `PoolWorker` (a pooled interpreter, a fork server, or a worker one
forked), and the kind of helper process its interpreters are (`POOL`: their cgroups' end and the
sweep of those a killed daemon left behind, `ddpd.daemon.contain.helpers`)."""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass, field

import anyio

from ...protocol.channel import Hello
from ..contain.cgroups import Cgroup
from ..contain.helpers import HelperKind
from .channel import WorkerChannel
from .poolkeys import PoolKey


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


# a pool interpreter's cgroup (``pool-<n>``): its end kills whatever the interpreter left in it (a
# forked escapee included); the sweep ends those a killed daemon left behind
POOL = HelperKind("pool", prefix="pool-", kill_wait=5.0)
