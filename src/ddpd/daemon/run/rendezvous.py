"""The attempt's rendezvous port: the daemon binds it, a process of the job's user serves the store.

The daemon binds the port itself (configured range or ephemeral), so a taken port is a clear error
or the next port, never a freeze (a loopback store whose whole range is held by others, which any
local user can do, falls back to an ephemeral port); it fences exactly that address and port for
the job's owner (`contain.portfence`) and only then listens, so no connection comes before the
rule and the rule never covers a port someone else holds. It never hosts the store:
the listening socket goes to the store's host, local rank 0 of the attempt, with its assignment
(SCM_RIGHTS on the rank's channel, `hand_over`), and the daemon closes its own copy. Rank 0 serves
``TCPStore(is_master=True, master_listen_fd=..., wait_for_workers=False)`` on it, as the job's user
and inside the attempt's cgroup; nothing any user sends to the port reaches the root daemon.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
from dataclasses import dataclass

import anyio
import structlog

from ...protocol.channel import Assign
from ..contain.portfence import Fence, FenceError, PortOwner, fence_port, unfence
from ..pool.channel import WorkerChannel

log = structlog.get_logger("ddpd")

LISTEN_TRIES = 3


class RendezvousError(RuntimeError):
    pass


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def bound(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port, not yet listening (OSError, the socket closed, when it cannot be)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(False)
    return sock


def bind_port(host: str, port_range: tuple[int, int] | None) -> socket.socket:
    """Bind (not listen) the first free port of the range (or an ephemeral one).

    A taken port is skipped, never waited on; an exhausted range is a clear error.
    """
    candidates = [0] if port_range is None else list(range(port_range[0], port_range[1] + 1))
    taken: list[int] = []
    for port in candidates:
        try:
            return bound(host, port)
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                taken.append(port)
                continue
            raise RendezvousError(f"cannot bind rendezvous port {host}:{port}: {exc.strerror}") from None
    assert port_range is not None
    raise RendezvousError(
        f"no free rendezvous port in {port_range[0]}-{port_range[1]} on {host} "
        f"(all {len(taken)} ports are in use)"
    )


@dataclass
class Rendezvous:
    """The attempt's store address; `listener` is the bound socket until rank 0 takes it (None on a
    node whose ranks connect to another node's store)."""

    host: str
    port: int
    listener: socket.socket | None = None
    hosted: bool = False  # a local rank serves the store (this daemon bound its port)
    fence: Fence | None = None  # the port's rule: its owner and root only, from this host
    unfenced: str = ""  # why the port has no rule, where it has none

    def close(self) -> None:
        """Close the daemon's copy of the listening socket (the store's host keeps its own)."""
        if self.listener is not None:
            self.listener.close()
            self.listener = None


async def open_rendezvous(host: str, port_range: tuple[int, int] | None, owner: PortOwner | None = None
                          ) -> Rendezvous:
    """The attempt's port: bound, fenced for `owner` on exactly its address and port (portfence),
    then listening. On a loopback host a `port_range` that others hold entirely (any local user can
    bind its ports) falls back to an ephemeral port, logged: no store port needs to cross a firewall
    there. Elsewhere (a multi-node store) it stays a RendezvousError naming the range. A port another
    process began to listen on between the bind and the listen is bound again (the next free one)."""
    for _ in range(LISTEN_TRIES):
        rdzv = Rendezvous(host=host, port=0, listener=_bind(host, port_range), hosted=True)
        assert rdzv.listener is not None
        rdzv.port = int(rdzv.listener.getsockname()[1])
        try:
            if await fenced_listen(rdzv, owner):
                return rdzv
        except BaseException:
            with anyio.CancelScope(shield=True):
                await close_rendezvous(rdzv)
            raise
        with anyio.CancelScope(shield=True):
            await close_rendezvous(rdzv)
    raise RendezvousError(f"rendezvous ports on {host} were taken between bind and listen {LISTEN_TRIES} times")


def _bind(host: str, port_range: tuple[int, int] | None) -> socket.socket:
    try:
        return bind_port(host, port_range)
    except RendezvousError as exc:
        if port_range is None or not _loopback(host) or not str(exc).startswith("no free rendezvous port"):
            raise
        log.warning("rendezvous.range_exhausted", host=host, port_range=list(port_range), fallback="ephemeral")
        return bind_port(host, None)


async def fenced_listen(rdzv: Rendezvous, owner: PortOwner | None) -> bool:
    """The bound port's rule installed (for `owner`; none without one), then listening; False (the
    rule kept in `rdzv.fence` for its caller to remove) when another process listens there first.
    A rule the owner requires that cannot be installed is a RendezvousError naming the port."""
    assert rdzv.listener is not None
    if owner is not None and rdzv.fence is None:
        address = str(rdzv.listener.getsockname()[0])  # what was bound (`host` may be a name)
        try:
            rdzv.fence, rdzv.unfenced = await fence_port(address, rdzv.port, owner)
        except FenceError as exc:
            raise RendezvousError(
                f"port {rdzv.port} on {rdzv.host} cannot be fenced to the job's owner ({exc}): a multi-node "
                "job's store would be open to every local user; refused (the daemon's operator may set "
                "allow_unfenced = true to run it unfenced)") from None
    try:
        rdzv.listener.listen(1024)
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise RendezvousError(f"cannot listen on {rdzv.host}:{rdzv.port}: {exc.strerror}") from None
        return False
    return True


async def close_rendezvous(rdzv: Rendezvous) -> None:
    """The daemon's copy of the socket closed and the port's rule removed (call it shielded)."""
    rdzv.close()
    rule, rdzv.fence = rdzv.fence, None
    await unfence(rule)


async def hand_over(rdzv: Rendezvous, channel: WorkerChannel, assign: Assign) -> bool:
    """Send `assign`, with the listening socket when it makes the rank the store's host; the
    daemon's copy is closed once sent. False when the worker is gone."""
    if not assign.serve_store or rdzv.listener is None:
        return await channel.send(assign)
    try:
        return await channel.send(assign, fds=(rdzv.listener.fileno(),))
    finally:
        rdzv.close()
