"""Multi-node jobs: the spec's rendezvous fields parsed, the global rank layout, and the node view.

Pure functions over plain values (no I/O): `parse_nnodes` reads torchrun's ``--nnodes`` (``N`` or
``MIN:MAX``), `parse_endpoint` its ``--rdzv-endpoint`` (``HOST:PORT``, ``[V6]:PORT``),
`check_run_id` its ``--rdzv-id``; each raises ValueError with the problem. `rank_layout` gives a
node's first global rank and the world size as torchrun assigns them: the local world sizes of the
nodes before it, summed in node-rank order. `NodeView` is what a daemon shows of one node of a job;
`node_of`, `local_ranks` and `elsewhere_text` read a job's node table (which node runs a global rank,
which ranks this daemon runs, and what a daemon answers for a rank it does not run).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import msgspec

MAX_NODES = 4096
MAX_RUN_ID = 128
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_HOST = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?$")


def parse_nnodes(text: str) -> tuple[int, int]:
    """``N`` -> (N, N); ``MIN:MAX`` -> (MIN, MAX), with 1 <= MIN <= MAX <= MAX_NODES."""
    lo_text, sep, hi_text = text.strip().partition(":")
    try:
        lo = int(lo_text)
        hi = int(hi_text) if sep else lo
    except ValueError:
        raise ValueError(f"expected N or MIN:MAX, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise ValueError(f"need 1 <= MIN <= MAX, got {text!r}")
    if hi > MAX_NODES:
        raise ValueError(f"at most {MAX_NODES} nodes, got {hi}")
    return lo, hi


def parse_endpoint(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (or ``[IPV6]:PORT``) -> (host, port), the port within 1..65535."""
    text = text.strip()
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or not rest.startswith(":") or not host or not re.fullmatch(r"[0-9A-Fa-f:.]+", host):
            raise ValueError(f"expected [IPV6]:PORT, got {text!r}")
        port_text = rest[1:]
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep or not host:
            raise ValueError(f"expected HOST:PORT, got {text!r}")
        if len(host) > 253 or not _HOST.match(host):
            raise ValueError(f"not a host name or address: {host!r}")
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ValueError(f"the port must be 1..65535, got {port_text!r}")
    return host, int(port_text)


def check_run_id(text: str) -> str:
    if not 0 < len(text) <= MAX_RUN_ID or not _RUN_ID.match(text):
        raise ValueError(f"1 to {MAX_RUN_ID} letters, digits, '.', '_' or '-' (first a letter or digit), "
                         f"got {text[:MAX_RUN_ID]!r}")
    return text


def rank_layout(local_sizes: list[int], node_rank: int) -> tuple[int, int]:
    """(the node's first global rank, the world size): `local_sizes[i]` is node rank i's ranks."""
    if not 0 <= node_rank < len(local_sizes):
        raise ValueError(f"node rank {node_rank} outside 0..{len(local_sizes) - 1}")
    return sum(local_sizes[:node_rank]), sum(local_sizes)


class NodeView(msgspec.Struct, omit_defaults=True):
    """One node of a multi-node job as a daemon knows it (its own record, or another's from the
    rendezvous store)."""

    node_rank: int
    host: str
    daemon: str  # hostname:pid of its daemon
    state: str  # starting, running, succeeded, failed, cancelled, timed_out, stopped, lost, unknown, ...
    ranks: list[int] = msgspec.field(default_factory=list)  # its global ranks
    local: bool = False  # this daemon's own node
    detail: str = ""


UNKNOWN = "unknown"  # a node this daemon stopped hearing from before it said how it ended


def node_of(nodes: Sequence[NodeView], rank: int) -> NodeView | None:
    """The node that runs global rank `rank` (None: no node of the table)."""
    return next((n for n in nodes if rank in n.ranks), None)


def local_ranks(nodes: Sequence[NodeView]) -> list[int] | None:
    """The global ranks of the daemon's own node (None: the table has no node of its own)."""
    return next((list(n.ranks) for n in nodes if n.local), None)


def daemon_text(daemon: str) -> str:
    """`host-a:1234` (a node record's daemon) -> "daemon pid 1234 on host-a"."""
    host, _, pid = daemon.rpartition(":")
    if not pid.isdigit():
        return f"daemon {daemon}"
    return f"daemon pid {pid} on {host}" if host else f"daemon pid {pid}"


def elsewhere_text(rank: int, node: NodeView) -> str:
    """What a daemon answers for a rank that another node runs."""
    return (f"rank {rank} runs on node {node.node_rank} (host {node.host}, {daemon_text(node.daemon)}): "
            f"ask that daemon")


def span_text(ranks: Sequence[int]) -> str:
    """`[0, 1, 2, 5]` -> "0-2,5": the ranks as sorted runs."""
    runs: list[tuple[int, int]] = []
    for r in sorted(set(ranks)):
        if runs and runs[-1][1] == r - 1:
            runs[-1] = (runs[-1][0], r)
        else:
            runs.append((r, r))
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
