"""Where a multi-node job's rendezvous endpoint is, seen from this daemon (blocking calls).

- `locate_endpoint`: whether the endpoint's host is one of this machine's (or network namespace's)
  addresses, found by binding it, and whether its port is taken. This daemon serves the endpoint
  (its job's rendezvous agent does, on the socket the daemon binds) when it is local and free.
- A local port that is taken is joined as a client only when the process listening on it is a
  ddpd rendezvous agent of the same user for the same run id (`port_holders`, from /proc: the
  listening socket's inode, the process holding it, its real uid and its environment): torchrun's
  one-host multi-node recipe, two daemons on one host. A port a ddpd daemon holds (bound, not yet
  handed to its agent) is looked at again when the job starts. Anything else is a NodeError naming it.
- `check_endpoint`, at submit: the above, a privileged port only for root, and never a wildcard
  address (``0.0.0.0``, ``::``): the endpoint is bound on the address the other nodes reach.
- `route_address`: this node's address on the way to the endpoint (what the other nodes reach).
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

from ...protocol.nodes import parse_endpoint
from ...protocol.spec import JobSpec
from ..run.rendezvous import RendezvousError

RDZV_ENV = b"DDPD_RDZV="
LISTEN = "0A"


class NodeError(RendezvousError):
    """The rendezvous cannot be reached, served or formed: the attempt fails with this text."""


@dataclass(frozen=True)
class Endpoint:
    address: str | None  # the endpoint's address when it is one of this host's, else None
    taken: bool = False  # its port is in use there


@dataclass(frozen=True)
class Holder:
    """The process listening on a local port."""

    pid: int
    uid: int
    ppid: int
    run_id: str | None  # its DDPD_RDZV (a ddpd rendezvous agent's run id)
    agent: bool  # its command line is a ddpd rendezvous agent's
    daemon: bool = False  # a ddpd daemon (root) that bound it and is about to hand it to its agent

    def describe(self) -> str:
        return f"the daemon with pid {self.ppid} (its rendezvous agent, pid {self.pid})"


def locate_endpoint(host: str, port: int) -> Endpoint:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise NodeError(f"rdzv_endpoint: cannot resolve {host!r}: {exc}") from None
    for family, _, _, _, addr in infos:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(addr[:2])
            except OSError as exc:
                if exc.errno == errno.EADDRNOTAVAIL:
                    continue
                return Endpoint(str(addr[0]), taken=True)
            return Endpoint(str(addr[0]))
    return Endpoint(None)


def taken_text(port: int, address: str, holder: Holder | None = None) -> str:
    why = "" if holder is None else (f" by pid {holder.pid} (uid {holder.uid}), not a ddpd rendezvous of this "
                                     "user for this run id")
    return (f"rdzv_endpoint: port {port} on {address} is taken{why} (Address already in use); "
            "this daemon serves the rendezvous there")


def joinable(holders: list[Holder], uid: int, run_id: str) -> bool:
    """A taken local endpoint that may be joined as a client: held by ddpd rendezvous agents of the
    same user for the same run id only (a process of another user, or anything else, never)."""
    return bool(holders) and all(h.agent and h.uid == uid and h.run_id == run_id for h in holders)


def check_endpoint(spec: JobSpec, owner_uid: int = 0) -> None:
    """Blocking, at submit: see the module docstring."""
    if not spec.rdzv_endpoint:
        return
    host, port = parse_endpoint(spec.rdzv_endpoint)
    try:
        if ipaddress.ip_address(host).is_unspecified:
            raise NodeError(f"rdzv_endpoint: {host} is no address the other nodes can reach; give this "
                            "node's address on their network")
    except ValueError:  # a host name
        pass
    found = locate_endpoint(host, port)
    if found.address is None:
        return
    if found.taken:
        holders = port_holders(found.address, port)
        if not joinable(holders, owner_uid, spec.rdzv_id) and not any(h.daemon for h in holders):
            raise NodeError(taken_text(port, found.address, next(iter(holders), None)))
    elif port < 1024 and owner_uid != 0:
        raise NodeError(f"rdzv_endpoint: port {port} is privileged: only root may have the daemon serve it")


def route_address(host: str, port: int) -> str:
    """Blocking: this node's address on the way to the endpoint (what the other nodes reach it at)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((host, port))
        except OSError as exc:
            raise NodeError(f"rdzv_endpoint: no route to {host}:{port}: {exc.strerror}") from None
        return str(sock.getsockname()[0])


# -- who listens on a local port (/proc) ---------------------------------------------------------


def _address(hex_text: str) -> str:
    raw = bytes.fromhex(hex_text)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, struct.pack("<I", int(hex_text, 16)))
    words = b"".join(struct.pack("<I", int(hex_text[i:i + 8], 16)) for i in range(0, 32, 8))
    v6 = ipaddress.IPv6Address(words)
    return str(v6.ipv4_mapped or v6)


def listening_inodes(address: str, port: int, proc: Path = Path("/proc")) -> set[int]:
    """Inodes of the sockets listening on address:port (or on the wildcard address of its family)."""
    want = ipaddress.ip_address(address)
    found = set()
    for table in ("net/tcp", "net/tcp6"):
        try:
            lines = (proc / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != LISTEN:
                continue
            local, _, port_hex = fields[1].partition(":")
            if int(port_hex, 16) != port:
                continue
            bound = ipaddress.ip_address(_address(local))
            if bound == want or bound.is_unspecified:
                found.add(int(fields[9]))
    return found


def port_holders(address: str, port: int, proc: Path = Path("/proc")) -> list[Holder]:
    """The processes holding the socket that listens on address:port (none found: empty)."""
    inodes = listening_inodes(address, port, proc)
    if not inodes:
        return []
    targets = {f"socket:[{i}]" for i in inodes}
    holders = []
    for name in os.listdir(proc):
        if name.isdigit() and _holds(proc / name, targets) and (holder := _describe(proc / name, int(name))):
            holders.append(holder)
    return holders


def _holds(pid_dir: Path, targets: set[str]) -> bool:
    try:
        for fd in os.listdir(pid_dir / "fd"):
            try:
                if os.readlink(pid_dir / "fd" / fd) in targets:
                    return True
            except OSError:
                continue
    except OSError:
        pass
    return False


def _describe(pid_dir: Path, pid: int) -> Holder | None:
    try:
        status = (pid_dir / "status").read_text()
        environ = (pid_dir / "environ").read_bytes().split(b"\0")
        cmdline = (pid_dir / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    uid = int(fields.get("Uid", "-1").split()[0])
    ppid = int(fields.get("PPid", "0").strip())
    run_id = next((e[len(RDZV_ENV):].decode(errors="replace") for e in environ if e.startswith(RDZV_ENV)), None)
    agent = b"ddpd.worker" in cmdline and b"--agent" in cmdline
    daemon = uid == 0 and any(arg == b"ddpd.daemon" or arg.endswith(b"/ddpd") for arg in cmdline[:3])
    return Holder(pid=pid, uid=uid, ppid=ppid, run_id=run_id, agent=agent, daemon=daemon)
