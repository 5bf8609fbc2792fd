"""A multi-node job on this daemon: torch's elastic rendezvous (through the job's agent), the rank
layout, and the node watch.

Membership, node ranks and re-forming come from torch's own elastic rendezvous
(``DynamicRendezvousHandler`` over the ``c10d`` backend, a TCPStore at the job's endpoint), as for
torchrun; nothing here is a cluster protocol of its own. None of torch's rendezvous runs in the
daemon: the job's rendezvous agent (`agentproc`, a process of the job's user) runs the handler
and, on the endpoint's host, serves the endpoint's store on a socket the daemon bound (and fenced:
`contain.portfence`). The daemon asks the agent and reads typed, bounded answers. A local endpoint
whose port is already served by a ddpd rendezvous agent of the same user for the same run id
(another daemon on this host) is joined as a client, as torchrun does (`elastic`).

Per attempt (`form`): the agent's ``next_rendezvous`` gives this node its rank and the node count;
each node writes its record (host, daemon, ranks on it) under the round's prefix in the store, the
global ranks follow torchrun's layout (`protocol.nodes.rank_layout`), and node rank 0's daemon
binds the attempt's worker store port on its own address (its local rank 0 serves it) and
publishes HOST:PORT there for the others' ranks. While the attempt runs (`poll`) each daemon counts
its heartbeat in the store and judges the others' with `nodewatch.NodeWatch` on its own clock; an
elastic job re-forms when nodes wait to join. A failing node writes its root cause in the store
(`settle`), so the others end at once and show it. When the job ends here (`close`) the daemon
reads how the other nodes ended (the daemon serving the store keeps it up until they have read
each other's ends); the job view (`nodes`) then holds every node's end, or "unknown".
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from dataclasses import dataclass

import anyio
import anyio.to_thread
import structlog

from ...protocol.agent import (
    AgentDone,
    AgentForm,
    AgentFormed,
    AgentGetMaster,
    AgentMaster,
    AgentOpen,
    AgentPoll,
    AgentPolled,
    AgentPublish,
    AgentReply,
    AgentRequest,
    AgentSetMaster,
    AgentShutdown,
    NodeRecord,
)
from ...protocol.limits import clip_text
from ...protocol.nodes import UNKNOWN, NodeView, parse_endpoint, parse_nnodes, rank_layout
from ...protocol.spec import JobSpec
from ..contain.portfence import Fence, PortOwner, unfence
from ..run.rendezvous import Rendezvous, bound, close_rendezvous, fenced_listen, open_rendezvous
from .agentproc import AgentLaunch, RendezvousAgent
from .elastic import NodeError, joinable, locate_endpoint, port_holders, route_address, taken_text
from .nodewatch import NodeWatch, Verdict

log = structlog.get_logger("ddpd")

DEFAULT_KEEP_ALIVE = 15.0  # torchrun's: 3 keep-alive beats of 5 s
DEFAULT_LAST_CALL = 30.0
CLOSE_TIMEOUT = 10.0
START_TIMEOUT = 60.0  # the agent's start and its store (an interpreter importing torch)
SETTLE = 15.0  # seconds a local endpoint bound by another ddpd daemon may take to reach its agent
SETTLE_INTERVAL = 0.2
FINAL = ("succeeded", "failed", "cancelled", "timed_out")
ENDED = (*FINAL, "stopped", "preempted", "lost", UNKNOWN)  # a node in one of these writes no more in this round

__all__ = ["NodeError", "NodeLayout", "NodeRecord", "NodeSession"]


@dataclass(frozen=True)
class NodeLayout:
    """Where this node's ranks sit in the attempt's world (as torchrun sets it across nodes)."""

    node_rank: int
    nnodes: int
    offset: int  # the global rank of this node's local rank 0
    world_size: int
    run_id: str
    restart_count: int


class NodeSession:
    """One multi-node job on this daemon, across its attempts (`form`, `poll`, `settle`, `close`)."""

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
        self.agent: RendezvousAgent | None = None  # the job's rendezvous agent on this node
        self.fence: Fence | None = None  # the endpoint port's, where this daemon serves it
        self.serving = False
        self.served_by = ""  # who serves the endpoint: this daemon, or another daemon on this host
        self.address = ""  # this node's address
        self.formed = False  # a round is current
        self.layout: NodeLayout | None = None
        self.watch_state: NodeWatch | None = None
        self.membership_changes = 0  # re-forms for waiting nodes: not counted against max_restarts
        self.nodes: list[NodeView] = []  # what this daemon knows of the job's nodes (the job view)
        self.records: dict[int, NodeRecord] = {}
        self.unfenced = ""  # why the endpoint port could not be fenced ("" when it is, or not served)

    async def _ask(self, request: AgentRequest, timeout: float, fds: tuple[int, ...] = ()) -> AgentReply:
        if self.agent is None:
            raise NodeError("the rendezvous agent is not running")
        return await self.agent.call(request, timeout, fds)

    def _id(self) -> int:
        assert self.agent is not None
        return self.agent.next_id()

    # -- forming ---------------------------------------------------------------------------

    async def open(self, launch: AgentLaunch, owner: PortOwner) -> None:
        """Start the job's agent and open the rendezvous (served here, or joined)."""
        if self.agent is not None:
            return
        self.agent = await RendezvousAgent.start(launch)  # first: the endpoint is bound only once it can take it
        listener = await self._endpoint(dataclasses.replace(owner, label=f"{launch.job_id}/rdzv"))
        try:
            fds = () if listener is None else (listener.fileno(),)
            request = AgentOpen(id=self._id(), run_id=self.spec.rdzv_id, host=self.host, port=self.port,
                                address=self.address, serve=listener is not None, min_nodes=self.min_nodes,
                                max_nodes=self.max_nodes, join_timeout=self.join_timeout,
                                last_call=self.last_call, keep_alive=self.keep_alive)
            await self._ask(request, START_TIMEOUT + self.join_timeout, fds)
        except TimeoutError:
            raise NodeError(f"the rendezvous store at {self.spec.rdzv_endpoint} did not answer within "
                            f"{self.join_timeout:.0f} s") from None
        finally:
            if listener is not None:
                listener.close()  # the agent has its own copy (or failed: the port is free again)
        log.info("nodes.opened", served_by=self.served_by, agent=self.agent.pid)

    async def _endpoint(self, owner: PortOwner) -> socket.socket | None:
        """The endpoint's listening socket where this daemon serves it; None where it joins (a remote
        endpoint, or a local one that a ddpd agent of this user serves for this run). A local port
        held by another ddpd daemon that has not yet handed it to its agent is looked at again for
        at most SETTLE seconds; anything else is a NodeError naming the holder."""
        deadline = time.monotonic() + SETTLE
        while True:
            found = await anyio.to_thread.run_sync(locate_endpoint, self.host, self.port)
            if found.address is None:
                self.address = await anyio.to_thread.run_sync(route_address, self.host, self.port)
                self.served_by = f"the daemon at {self.host}"
                return None
            if not found.taken and (listener := await self._bind_fenced(found.address, owner)) is not None:
                self.serving, self.address, self.served_by = True, found.address, "this daemon"
                return listener
            holders = await anyio.to_thread.run_sync(port_holders, found.address, self.port)
            if joinable(holders, owner.uid, self.spec.rdzv_id):
                self.address, self.served_by = found.address, holders[0].describe()
                return None
            if time.monotonic() > deadline or not any(h.daemon for h in holders):
                raise NodeError(taken_text(self.port, found.address, next(iter(holders), None)))
            await anyio.sleep(SETTLE_INTERVAL)

    async def _bind_fenced(self, address: str, owner: PortOwner) -> socket.socket | None:
        """The endpoint bound on `address`, its rule installed (that address and port alone), then
        listening: no connection comes before the rule, and the rule never covers a port another
        process holds. None when the port was taken in between. A rule the job requires (multi-node,
        no allow_unfenced) that cannot be installed is a RendezvousError."""
        try:
            endpoint = Rendezvous(host=address, port=self.port, listener=bound(address, self.port), fence=self.fence)
        except OSError:
            return None
        try:
            listening = await fenced_listen(endpoint, owner)
        except BaseException:
            endpoint.close()  # a rule installed stays in self.fence: `close` removes it
            raise
        finally:
            self.fence, self.unfenced = endpoint.fence, endpoint.unfenced or self.unfenced
        if not listening:
            self.fence = None
            with anyio.CancelScope(shield=True):
                await close_rendezvous(endpoint)
            return None
        return endpoint.listener

    async def form(self, number: int, nproc: int, launch: AgentLaunch, owner: PortOwner
                   ) -> tuple[Rendezvous, NodeLayout]:
        """Join the next round; this node's layout, and the attempt's worker store (bound and fenced
        for `owner` here on node 0)."""
        await self.open(launch, owner)
        record = NodeRecord(host=self.address, daemon=self.daemon, nproc=nproc, state="starting")
        try:
            formed = await self._ask(AgentForm(id=self._id(), record=record, timeout=self.join_timeout),
                                     self.join_timeout * 2 + 10)
        except TimeoutError:
            raise NodeError(f"the rendezvous {self.spec.rdzv_id} at {self.spec.rdzv_endpoint} did not form "
                            f"within {self.join_timeout:.0f} s ({self.spec.nnodes} nodes)") from None
        assert isinstance(formed, AgentFormed)
        node, nnodes = formed.node_rank, formed.nnodes
        if len(formed.records) != nnodes or node >= nnodes or any(r is None for r in formed.records):
            raise NodeError("a node published a bad record in the rendezvous store")
        self.formed = True
        self.records = {i: r for i, r in enumerate(formed.records) if r is not None}
        offset, world = rank_layout([r.nproc for r in self.records.values()], node)
        self.layout = NodeLayout(node, nnodes, offset, world, self.spec.rdzv_id,
                                 number - 1 - self.membership_changes)
        rdzv = await self._worker_store(node, owner)
        self.watch_state = None
        self._view()
        log.info("nodes.formed", node_rank=node, nnodes=nnodes, offset=offset, world_size=world,
                 master=f"{rdzv.host}:{rdzv.port}")
        return rdzv, self.layout

    async def _worker_store(self, node: int, owner: PortOwner) -> Rendezvous:
        """Node 0: bind (and fence) the attempt's worker store port and publish it; the others: read it."""
        if node == 0:
            rdzv = await open_rendezvous(self.address, self.port_range, owner)
            try:
                await self._ask(AgentSetMaster(id=self._id(), address=f"{rdzv.host}:{rdzv.port}"), self.keep_alive)
            except (NodeError, TimeoutError) as exc:
                with anyio.CancelScope(shield=True):
                    await close_rendezvous(rdzv)
                raise NodeError(f"cannot publish the worker store: {exc}") from None
            return rdzv
        try:
            reply = await self._ask(AgentGetMaster(id=self._id(), timeout=self.join_timeout), self.join_timeout + 5)
        except TimeoutError as exc:
            raise NodeError(f"node 0 did not publish its worker store: {exc}") from None
        assert isinstance(reply, AgentMaster)
        host, _, port = reply.address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536 or len(host) > 255:
            raise NodeError(f"node 0 published a bad worker store address: {reply.address[:300]!r}")
        return Rendezvous(host=host, port=int(port))

    # -- watching --------------------------------------------------------------------------

    async def poll(self, now: float) -> Verdict | None:
        """Count our heartbeat, read the others' and their records; the verdict if the attempt must end."""
        layout = self.layout
        assert layout is not None and self.formed
        if self.watch_state is None:
            peers = [n for n in range(layout.nnodes) if n != layout.node_rank]
            self.watch_state = NodeWatch(self.keep_alive, peers, now)
        watch = self.watch_state
        n = layout.nnodes
        request = AgentPoll(id=self._id(), node_rank=layout.node_rank, nnodes=n, elastic=n < self.max_nodes)
        try:
            polled = await self._ask(request, self.interval * 2)
        except (NodeError, TimeoutError):
            return watch.verdict(now)
        assert isinstance(polled, AgentPolled)
        watch.answered(now)
        for i, (beat, record) in enumerate(zip(polled.beats[:n], polled.records[:n], strict=False)):
            if beat is not None:
                watch.beat(i, beat, now)
            known = self.records.get(i)
            if record is not None and (known is None or known.state != "lost"):  # another machine's writing:
                self.records[i] = record  # ignored when bad; a node this daemon found lost stays so this round
        if polled.failed is not None:
            watch.failed(clip_text(polled.failed))
        self._view()
        if polled.waiting > 0:
            return Verdict("waiting", node=polled.waiting)
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
        layout = self.layout
        if layout is None or not self.formed or self.agent is None:
            return
        own = self.records.get(layout.node_rank)
        record = NodeRecord(host=self.address, daemon=self.daemon, nproc=0 if own is None else own.nproc, state=state)
        self.records[layout.node_rank] = record
        request = AgentPublish(id=self._id(), node_rank=layout.node_rank, record=record,
                               failure=None if failure is None else clip_text(failure))
        try:
            await self._ask(request, self.interval * 2)
        except (NodeError, TimeoutError):
            log.warning("nodes.publish_failed", state=state)
        self._view()

    def _view(self) -> None:
        layout = self.layout
        views = []
        for i, r in sorted(self.records.items()):
            first = sum(self.records[j].nproc for j in range(i) if j in self.records)
            local = layout is not None and i == layout.node_rank
            views.append(NodeView(node_rank=i, host=r.host, daemon=r.daemon, state=r.state,
                                  ranks=list(range(first, first + r.nproc)), local=local,
                                  detail=f"rendezvous served by {self.served_by}" if local and self.served_by else ""))
        self.nodes[:] = views

    # -- the end ---------------------------------------------------------------------------

    async def close(self, state: str, final: bool = True) -> None:
        """The job ended here (`final`; else it goes back to the queue and will join again): say so,
        close the rendezvous if it ended (torchrun's shutdown) and read how the other nodes ended
        (`_last_reads`); then end the agent. A node whose end this daemon did not read is left
        "unknown" in the job view, never as it was last seen."""
        try:
            await self.publish(state)
            if self.agent is not None and final:
                try:
                    reply = await self._ask(AgentShutdown(id=self._id()), CLOSE_TIMEOUT)
                    assert isinstance(reply, AgentDone)
                except (NodeError, TimeoutError):
                    log.warning("nodes.shutdown_failed")
            if final and self.formed and self.layout is not None:
                await self._last_reads()
        finally:
            with anyio.CancelScope(shield=True):
                if self.agent is not None:
                    await self.agent.close()
                await unfence(self.fence)
            self.agent, self.fence, self.formed = None, None, False
            self._unknown()

    async def _last_reads(self) -> None:
        """Read the nodes' records until each says how it ended, for at most keep_alive, or until the
        store stops answering. The daemon serving the store keeps it up until every other node has
        read those ends too: until each one's heartbeat moved after they had all ended (each beat
        comes with a read of the records). The others read twice more once they saw every end."""
        assert self.layout is not None
        nodes = range(self.layout.nnodes)
        peers = [n for n in nodes if n != self.layout.node_rank]
        seen: dict[int, int] | None = None  # the peers' counters when all had ended (serving)
        extra = 2
        with anyio.move_on_after(self.keep_alive):
            while True:
                answered = None if self.watch_state is None else self.watch_state.last_answer
                await self.poll(time.monotonic())
                watch = self.watch_state
                if watch is None or watch.last_answer == answered:  # the store did not answer: it is gone
                    break
                if all(n in self.records and self.records[n].state in ENDED for n in nodes):
                    if not self.serving:
                        extra -= 1
                        if extra < 0:
                            break
                    elif seen is None:  # (a node found lost reads nothing more: not waited for)
                        seen = {n: watch.last_value.get(n, -1) for n in peers if self.records[n].state != "lost"}
                    if seen is not None and all(watch.last_value.get(n, -1) != beat for n, beat in seen.items()):
                        break
                await anyio.sleep(self.interval)

    def _unknown(self) -> None:
        """This daemon reads no more: another node that did not say how it ended is "unknown"."""
        own = None if self.layout is None else self.layout.node_rank
        for n, record in self.records.items():
            if n != own and record.state not in ENDED:
                record.state = UNKNOWN
        self._view()
