"""Two "nodes" on this machine: network namespaces joined by a veth pair, made and removed by a test.

Each namespace gets its loopback and one link named `LINK` (the same name in both, so one
``GLOO_SOCKET_IFNAME`` serves every node) with the address in `ADDRESSES`. `cut` takes a node's
link down (a network cut). Needs root and `ip netns`; `unavailable` says why not, for a skip.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

LINK = "mn0"
ADDRESSES = ("10.77.0.1", "10.77.0.2")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def unavailable() -> str | None:
    """Why two namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    name = f"ddpd-probe-{os.getpid()}"
    try:
        _ip("netns", "add", name)
    except (subprocess.CalledProcessError, OSError) as exc:
        return f"`ip netns add` does not work here: {exc}"
    _ip("netns", "del", name)
    return None


@dataclass(frozen=True)
class Node:
    ns: str
    address: str

    @property
    def prefix(self) -> tuple[str, ...]:
        """The command prefix that runs a process on this node."""
        return ("ip", "netns", "exec", self.ns)

    def cut(self) -> None:
        _ip("-n", self.ns, "link", "set", LINK, "down")


@contextmanager
def two_nodes() -> Iterator[tuple[Node, Node]]:
    tag = f"{os.getpid()}"
    nodes = (Node(f"ddpd-a-{tag}", ADDRESSES[0]), Node(f"ddpd-b-{tag}", ADDRESSES[1]))
    ends = (f"mna{tag}"[:15], f"mnb{tag}"[:15])
    try:
        for node in nodes:
            _ip("netns", "add", node.ns)
        _ip("link", "add", ends[0], "type", "veth", "peer", "name", ends[1])
        for node, end in zip(nodes, ends, strict=True):
            _ip("link", "set", end, "netns", node.ns)
            _ip("-n", node.ns, "link", "set", end, "name", LINK)
            _ip("-n", node.ns, "addr", "add", f"{node.address}/24", "dev", LINK)
            _ip("-n", node.ns, "link", "set", LINK, "up")
            _ip("-n", node.ns, "link", "set", "lo", "up")
        yield nodes
    finally:
        for node in nodes:
            subprocess.run(["ip", "netns", "del", node.ns], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", ends[0]], capture_output=True, timeout=30)
