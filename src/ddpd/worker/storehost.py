"""The attempt's store, served by the rank that hosts it (local rank 0 where the daemon bound the port).

The daemon binds the attempt's port and passes the listening socket with this rank's assignment
(`Assign.serve_store`, SCM_RIGHTS on the channel: `Channel.fds`). Before its task or script runs,
the rank serves ``TCPStore(is_master=True, master_listen_fd=..., wait_for_workers=False)`` on it,
in its own process (the job's user, the attempt's cgroup, no interpreter start of its own). Its
own ranks' clients connect to it as to any store: the built-in loop with ``store=``, a script
through ``MASTER_ADDR``/``MASTER_PORT`` with ``TORCHELASTIC_USE_AGENT_STORE=True``.

After its result the host keeps serving until the daemon's ``Release`` (every other local rank has
exited), as torchrun's agent keeps its store until its workers are done; a host that dies takes
the store with it, which the attempt sees as that rank's failure.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from ddpd.protocol.channel import Assign

from .runtime import Runtime


class NoListener(RuntimeError):
    """The assignment names this rank the store's host, but no socket came with it."""


def serve_store(runtime: Runtime, assign: Assign) -> Any:
    """The attempt's TCPStore on the socket the daemon passed (kept alive until `os._exit`)."""
    if not runtime.channel.fds:
        raise NoListener("the daemon named this rank the store's host but passed no listening socket")
    fd = runtime.channel.fds.pop(0)
    for extra in runtime.channel.fds:  # anything else that came along is not ours to keep
        os.close(extra)
    runtime.channel.fds.clear()
    import torch.distributed as dist

    try:
        store = dist.TCPStore(assign.store_host, assign.store_port, world_size=None, is_master=True,
                              timeout=timedelta(seconds=max(1.0, assign.join_timeout)),
                              wait_for_workers=False, master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise
    runtime.keepalive.append(store)
    runtime.private_fds.append(fd)  # a child the rank forks must not hold the port (pyexit)
    return store


def hold_store(runtime: Runtime, assign: Assign) -> None:
    """After the host's result: keep serving until the daemon releases it (its channel closing ends
    the process anyway)."""
    if assign.serve_store:
        runtime.released.wait()
