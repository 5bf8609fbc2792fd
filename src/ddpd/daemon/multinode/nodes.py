"""A multi-node job on this daemon: torch's elastic rendezvous, the rank layout, and the node watch.

Membership, node ranks and re-forming come from torch's own elastic rendezvous
(``DynamicRendezvousHandler`` over the ``c10d`` backend, a TCPStore at the job's endpoint), as for
torchrun; nothing here is a cluster protocol of its own. The daemon whose addresses include the
endpoint's host binds the endpoint port itself and serves that store for the whole job (a taken
port is an error naming it); the others connect as clients (see `elastic`). Every blocking call
of torch runs in a daemon thread, bounded by a deadline and abandoned on cancellation
(`elastic.call_blocking`), never on the event loop.

Per attempt (`form`): ``next_rendezvous`` gives this node its rank and the node count; each node
writes its record (host, daemon, ranks on it) under the round's prefix in the store, the global
ranks follow torchrun's layout (`protocol.nodes.rank_layout`), and node rank 0's daemon binds the
attempt's worker store on its own address and publishes HOST:PORT there for the others' ranks.
While the attempt runs (`watch`) each daemon counts its heartbeat in the store and judges the
others' with `nodewatch.NodeWatch` on its own clock; an elastic job re-forms when nodes wait to
join. A failing node writes its root cause in the store (`settle`), so the others end at once and
show it.
"""

from __future__ import annotations

import functools
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Annotated, Any, TypeVar

import anyio
import msgspec
import structlog

from ...protocol.limits import clip_text
from ...protocol.nodes import NodeView, parse_endpoint, parse_nnodes, rank_layout
from ...protocol.spec import MAX_NPROC, JobSpec
from ..attempt.rendezvous import Rendezvous, open_rendezvous
from .elastic import (
    CLOSE_TIMEOUT,
    NodeError,
    call_blocking,
    endpoint_address,
    make_handler,
    route_address,
    serve_store,
)
from .nodewatch import NodeWatch, Verdict

log = structlog.get_logger("ddpd")
T = TypeVar("T")

DEFAULT_KEEP_ALIVE = 15.0  # torchrun's: 3 keep-alive beats of 5 s
DEFAULT_LAST_CALL = 30.0
FAILED_KEY = "ddpd/failed"
MASTER_KEY = "ddpd/master"
FINAL = ("succeeded", "failed", "cancelled", "timed_out")


@dataclass(frozen=True)
class NodeLayout:
    """Where this node's ranks sit in the attempt's world (as torchrun sets it across nodes)."""

    node_rank: int
    nnodes: int
    offset: int  # the global rank of this node's local rank 0
    world_size: int
    run_id: str
    restart_count: int


class NodeRecord(msgspec.Struct, forbid_unknown_fields=True):
    """What each node's daemon writes about itself in the round's store (read back typed and bounded)."""

    host: Annotated[str, msgspec.Meta(max_length=255)]
    daemon: Annotated[str, msgspec.Meta(max_length=300)]
    nproc: Annotated[int, msgspec.Meta(ge=0, le=MAX_NPROC)]
    state: Annotated[str, msgspec.Meta(max_length=32)]


class NodeSession:
    """One multi-node job on this daemon, across its attempts (`form`, `watch`, `settle`, `close`)."""

    def __init__(self, spec: JobSpec, port_range: tuple[int, int] | None, join_timeout: float,
                 daemon: str | None = None) -> None:
        self.spec = spec
        self.host, self.port = parse_endpoint(spec.rdzv_endpoint)
        self.min_nodes, self.max_nodes = parse_nnodes(spec.nnodes)
        self.keep_alive = spec.rdzv_keep_alive or DEFAULT_KEEP_ALIVE
        self.last_call = DEFAULT_LAST_CALL if spec.rdzv_last_call is None else spec.rdzv_last_call
        self.interval = min(2.0, max(0.1, self.keep_alive / 5))
        self.port_range = port_range
        self.join_timeout = join_timeout
        self.daemon = daemon or f"{socket.gethostname()}:{os.getpid()}"
        self.store: Any = None  # the rendezvous store (served here, or a client)
        self.serving = False
        self.handler: Any = None
        self.address = ""  # this node's address
        self.round: Any = None  # the current round's prefix store
        self.layout: NodeLayout | None = None
        self.watch_state: NodeWatch | None = None
        self.membership_changes = 0  # re-forms for waiting nodes: not counted against max_restarts
        self.nodes: list[NodeView] = []  # what this daemon knows of the job's nodes (the job view)
        self.records: dict[int, NodeRecord] = {}

    async def _call(self, fn: Callable[..., T], *args: Any, timeout: float) -> T:
        return await call_blocking(fn, *args, timeout=timeout)

    # -- forming ---------------------------------------------------------------------------

    async def open(self) -> None:
        if self.handler is not None:
            return
        local = await self._call(endpoint_address, self.host, self.port, timeout=30)
        if local is not None:
            self.store = await self._call(serve_store, local, self.port, self.keep_alive, timeout=30)
            self.serving, self.address = True, local
        else:
            import torch.distributed as dist

            self.address = await self._call(route_address, self.host, self.port, timeout=30)
            try:
                self.store = await self._call(
                    functools.partial(dist.TCPStore, self.host, self.port, is_master=False,
                                      timeout=timedelta(seconds=self.join_timeout)), timeout=self.join_timeout + 5)
            except (RuntimeError, TimeoutError) as exc:
                raise NodeError(f"the rendezvous store at {self.spec.rdzv_endpoint} did not answer within "
                                f"{self.join_timeout:.0f} s: {exc}") from None
        self.handler = await self._call(make_handler, self.store, self.spec.rdzv_id, self.min_nodes, self.max_nodes,
                                        self.address, self.join_timeout, self.last_call, self.keep_alive,
                                        timeout=30)

    async def form(self, number: int, nproc: int) -> tuple[Rendezvous, NodeLayout]:
        """Join the next round; this node's layout, and the attempt's worker store (served here on node 0)."""
        try:
            await self.open()
            info = await self._call(self.handler.next_rendezvous, timeout=self.join_timeout + 10)
        except TimeoutError:
            raise NodeError(f"the rendezvous {self.spec.rdzv_id} at {self.spec.rdzv_endpoint} did not form "
                            f"within {self.join_timeout:.0f} s ({self.spec.nnodes} nodes)") from None
        except RuntimeError as exc:  # torch's RendezvousError and store errors
            raise NodeError(f"rendezvous {self.spec.rdzv_id}: {type(exc).__name__}: {exc}") from None
        node, nnodes = int(info.rank), int(info.world_size)
        self.round = store = info.store
        record = NodeRecord(host=self.address, daemon=self.daemon, nproc=nproc, state="starting")
        keys = [f"ddpd/node/{n}" for n in range(nnodes)]

        def exchange() -> list[bytes]:
            store.set(keys[node], msgspec.json.encode(record))
            store.add(f"ddpd/hb/{node}", 1)
            store.wait(keys, timedelta(seconds=self.join_timeout))
            return list(store.multi_get(keys))

        try:
            raw = await self._call(exchange, timeout=self.join_timeout + 5)
        except (RuntimeError, TimeoutError) as exc:
            raise NodeError(f"the {nnodes} nodes did not all publish their records: {exc}") from None
        try:  # written by other machines: typed and bounded before use
            records = [msgspec.json.decode(bytes(v), type=NodeRecord) for v in raw]
        except msgspec.ValidationError as exc:
            raise NodeError(f"a node published a bad record in the rendezvous store: {exc}") from None
        self.records = dict(enumerate(records))
        sizes = [r.nproc for r in records]
        offset, world = rank_layout(sizes, node)
        self.layout = NodeLayout(node, nnodes, offset, world, self.spec.rdzv_id,
                                 number - 1 - self.membership_changes)
        if node == 0:
            rdzv = await open_rendezvous(self.address, self.port_range)
            await self._call(store.set, MASTER_KEY, f"{rdzv.host}:{rdzv.port}", timeout=self.keep_alive)
        else:
            def master() -> str:
                store.wait([MASTER_KEY], timedelta(seconds=self.join_timeout))
                return bytes(store.get(MASTER_KEY)).decode()

            try:
                value = await self._call(master, timeout=self.join_timeout + 5)
            except (RuntimeError, TimeoutError) as exc:
                raise NodeError(f"node 0 did not publish its worker store: {exc}") from None
            host, _, port = value.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536 or len(host) > 255:
                raise NodeError(f"node 0 published a bad worker store address: {value[:300]!r}")
            rdzv = Rendezvous(host=host, port=int(port))
        self.watch_state = None
        self._view()
        log.info("nodes.formed", node_rank=node, nnodes=nnodes, offset=offset, world_size=world,
                 master=f"{rdzv.host}:{rdzv.port}")
        return rdzv, self.layout

    # -- watching --------------------------------------------------------------------------

    async def poll(self, now: float) -> Verdict | None:
        """Count our heartbeat, read the others' and their records; the verdict if the attempt must end."""
        layout, store = self.layout, self.round
        assert layout is not None and store is not None
        if self.watch_state is None:
            peers = [n for n in range(layout.nnodes) if n != layout.node_rank]
            self.watch_state = NodeWatch(self.keep_alive, peers, now)
        watch = self.watch_state
        n = layout.nnodes
        keys = [f"ddpd/hb/{i}" for i in range(n)] + [f"ddpd/node/{i}" for i in range(n)]
        elastic = n < self.max_nodes

        def read() -> tuple[list[bytes], str | None, int]:
            store.add(f"ddpd/hb/{layout.node_rank}", 1)
            values = store.multi_get(keys)
            failed = bytes(store.get(FAILED_KEY)).decode() if store.check([FAILED_KEY]) else None
            waiting = int(self.handler.num_nodes_waiting()) if elastic else 0
            return values, failed, waiting

        try:
            values, failed, waiting = await self._call(read, timeout=self.interval * 2)
        except (RuntimeError, TimeoutError, OSError, ValueError):
            return watch.verdict(now)
        watch.answered(now)
        for i in range(n):
            try:
                watch.beat(i, int(values[i]), now)
                self.records[i] = msgspec.json.decode(bytes(values[n + i]), type=NodeRecord)
            except (ValueError, msgspec.ValidationError):  # another machine's writing: ignored when bad
                pass
        if failed is not None:
            watch.failed(clip_text(failed))
        self._view()
        if waiting > 0:
            return Verdict("waiting", node=waiting)
        return watch.verdict(now)

    def describe(self, verdict: Verdict) -> str:
        """The root cause's text for a verdict."""
        if verdict.kind == "failed":
            return verdict.detail
        if verdict.kind == "unreachable":
            host_node = next((i for i, r in self.records.items() if r.host == self.host), None)
            who = "the daemon serving the rendezvous" if host_node is None else f"daemon of node {host_node}"
            return (f"{who} unreachable: the rendezvous store at {self.spec.rdzv_endpoint} did not answer for "
                    f"{self.keep_alive:.0f} s")
        if verdict.kind == "waiting":
            return f"{verdict.node} node(s) waiting to join: re-forming"
        record = self.records.get(verdict.node or 0)
        host = "?" if record is None else record.host
        return (f"node {verdict.node} (host {host}) lost: no heartbeat in the rendezvous store for "
                f"{self.keep_alive:.0f} s")

    def mark(self, verdict: Verdict) -> None:
        """Show a lost node as such in the job view."""
        if verdict.kind == "lost" and verdict.node in self.records:
            self.records[verdict.node].state = "lost"
        self._view()

    async def publish(self, state: str, failure: str | None = None) -> None:
        """Our record's state (and the attempt's root cause, the first one written wins); never raises."""
        layout, store = self.layout, self.round
        if layout is None or store is None:
            return
        own = self.records.get(layout.node_rank)
        record = NodeRecord(host=self.address, daemon=self.daemon, nproc=0 if own is None else own.nproc, state=state)
        self.records[layout.node_rank] = record

        def write() -> None:
            store.set(f"ddpd/node/{layout.node_rank}", msgspec.json.encode(record))
            if failure is not None:
                store.compare_set(FAILED_KEY, "", failure)

        try:
            await self._call(write, timeout=self.interval * 2)
        except (RuntimeError, TimeoutError, OSError):
            log.warning("nodes.publish_failed", state=state)
        self._view()

    def _view(self) -> None:
        layout = self.layout
        views = []
        for i, r in sorted(self.records.items()):
            first = sum(self.records[j].nproc for j in range(i) if j in self.records)
            views.append(NodeView(node_rank=i, host=r.host, daemon=r.daemon, state=r.state,
                                  ranks=list(range(first, first + r.nproc)),
                                  local=layout is not None and i == layout.node_rank))
        self.nodes[:] = views

    # -- the end ---------------------------------------------------------------------------

    async def close(self, state: str, final: bool = True) -> None:
        """The job ended here (`final`; else it goes back to the queue and will join again): say so,
        close the rendezvous if it ended (torchrun's shutdown), and when serving it, keep the store
        up until every node has said it ended (at most keep_alive)."""
        try:
            await self.publish(state)
            if self.handler is not None and final:
                try:
                    await self._call(self.handler.shutdown, timeout=CLOSE_TIMEOUT)
                except (RuntimeError, TimeoutError):
                    log.warning("nodes.shutdown_failed")
            if self.serving and self.round is not None and self.layout is not None:
                with anyio.move_on_after(self.keep_alive):
                    while not all(r.state in FINAL for r in self.records.values()):
                        await anyio.sleep(self.interval)
                        verdict = await self.poll(time.monotonic())
                        if verdict is not None and verdict.kind in ("lost", "unreachable"):
                            break
        finally:
            self.store = self.round = self.handler = None
