"""The attempt's rendezvous: the daemon binds the port itself, then hosts a TCPStore on it."""

from __future__ import annotations

import errno
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import anyio.to_thread


class RendezvousError(RuntimeError):
    pass


def listen_on(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port and listening (OSError, the socket closed, when it cannot be)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    return sock


def bind_port(host: str, port_range: tuple[int, int] | None) -> socket.socket:
    """Bind and listen on the first free port of the range (or an ephemeral one).

    A taken port is skipped, never waited on; an exhausted range is a clear error.
    """
    candidates = [0] if port_range is None else list(range(port_range[0], port_range[1] + 1))
    taken: list[int] = []
    for port in candidates:
        try:
            sock = listen_on(host, port)
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                taken.append(port)
                continue
            raise RendezvousError(f"cannot bind rendezvous port {host}:{port}: {exc.strerror}") from None
        sock.set_inheritable(False)
        return sock
    assert port_range is not None
    raise RendezvousError(
        f"no free rendezvous port in {port_range[0]}-{port_range[1]} on {host} "
        f"(all {len(taken)} ports are in use)"
    )


@dataclass
class Rendezvous:
    host: str
    port: int
    store: Any  # torch.distributed.TCPStore; it owns the listening socket

    def close(self) -> None:
        self.store = None  # the server stops and closes its socket when its last reference goes


async def open_rendezvous(host: str, port_range: tuple[int, int] | None, world_size: int) -> Rendezvous:
    sock = bind_port(host, port_range)
    port = int(sock.getsockname()[1])
    fd = sock.detach()  # the store takes the descriptor over and closes it itself

    def make_store() -> Any:
        import torch.distributed as dist

        return dist.TCPStore(
            host,
            port,
            world_size=world_size,
            is_master=True,
            timeout=timedelta(seconds=30),
            wait_for_workers=False,
            master_listen_fd=fd,
        )

    try:
        store = await anyio.to_thread.run_sync(make_store)
    except BaseException:
        os.close(fd)
        raise
    return Rendezvous(host=host, port=port, store=store)
