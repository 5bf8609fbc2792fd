"""A pool member that never says Hello, for the pool's unit tests: a real sleeping process (a
PoolWorker holds a Popen, as the pool's spawn gives it) on a real socket pair, its channel's other
end held open; afterwards the process is killed and reaped and both ends closed."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
from collections.abc import AsyncIterator

import anyio
import anyio.to_thread

from ddpd.daemon.pool.channel import WorkerChannel
from ddpd.daemon.pool.members import ForkServer
from ddpd.daemon.pool.pool import PoolWorker
from ddpd.daemon.pool.poolkeys import PoolKey

KEY = PoolKey.of(0, sys.executable, {})


def sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sleep", "60"])


@contextlib.asynccontextmanager
async def silent_member(server: bool = False) -> AsyncIterator[PoolWorker]:
    """A member of `KEY` that never says Hello (a fork server's with `server`)."""
    ours, theirs = socket.socketpair()
    proc = sleeper()
    w = PoolWorker(proc, WorkerChannel(ours), KEY, {}, server=ForkServer() if server else None)
    try:
        yield w
    finally:
        proc.kill()
        await anyio.to_thread.run_sync(proc.wait)
        w.channel.close()
        theirs.close()
