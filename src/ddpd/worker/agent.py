"""The rendezvous agent of a multi-node job: torch's elastic rendezvous, as the job's user.

``python -m ddpd.worker --fd N --parent PID --agent``: started by the daemon for a multi-node job
on this node, as the job's user, in a cgroup and process group of its own, for the job's life
here (torch's rendezvous state must outlive an attempt, as torchrun's agent does). It runs what
the root daemon must never run: torch's ``DynamicRendezvousHandler`` over the ``c10d`` backend
(which unpickles the state key of its store) and, on the endpoint's host, the endpoint's
TCPStore, served on the listening socket the daemon bound and passed with `AgentOpen`.

It answers the daemon's requests (`ddpd.protocol.agent`) each in a thread of its own (a
``next_rendezvous`` may block for the join timeout while the daemon closes the job), with plain,
typed, bounded replies: node ranks, the world's size, the records and heartbeats the nodes wrote,
a written failure. What other nodes wrote is decoded here and again by the daemon.

Like a rank, it dies with its channel (PR_SET_PDEATHSIG, and channel EOF ends it).
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NoReturn

import msgspec

from ddpd.protocol.agent import (
    AgentDone,
    AgentError,
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
from ddpd.protocol.framing import Decoder, FrameError, LineSplitter
from ddpd.protocol.limits import TEXT_LIMIT, clip_text
from ddpd.protocol.nodes import MAX_NODES

from .runtime import Channel

CLOSE_TIMEOUT = 10.0
FAILED_KEY = "ddpd/failed"
MASTER_KEY = "ddpd/master"
RECORD_BYTES = 4096  # a node record is far smaller: anything larger is not one


class Agent:
    """torch's rendezvous for one job on this node: the store, the handler, the current round."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.store: Any = None
        self.handler: Any = None
        self.round: Any = None
        self.node_rank = 0
        self.keep_alive = 15.0

    def reply(self, message: AgentReply) -> None:
        self.channel.send(message)  # one lock for every thread; a closed channel ends the agent

    def handle(self, request: AgentRequest) -> None:
        """Answer one request (in its own thread); any failure is an AgentError, never a crash."""
        try:
            self.reply(self.dispatch(request))
        except TimeoutError as exc:
            self.reply(AgentError(id=request.id, kind="timeout", message=clip_text(str(exc) or "timed out")))
        except Exception as exc:  # torch's RendezvousError, store errors, a bad record
            self.reply(AgentError(id=request.id, kind="rendezvous",
                                  message=clip_text(f"{type(exc).__name__}: {exc}", TEXT_LIMIT)))

    def dispatch(self, request: AgentRequest) -> AgentReply:
        match request:
            case AgentOpen():
                self.open(request)
                return AgentDone(id=request.id)
            case AgentForm():
                return self.form(request)
            case AgentSetMaster(address=address):
                self.round.set(MASTER_KEY, address)
                return AgentDone(id=request.id)
            case AgentGetMaster(timeout=timeout):
                self.round.wait([MASTER_KEY], timedelta(seconds=timeout))
                return AgentMaster(id=request.id, address=clip_text(bytes(self.round.get(MASTER_KEY)).decode(
                    errors="replace"), 300))
            case AgentPoll():
                return self.poll(request)
            case AgentPublish():
                self.publish(request)
                return AgentDone(id=request.id)
            case AgentShutdown():
                if self.handler is not None:
                    self.handler.shutdown()
                return AgentDone(id=request.id)

    def open(self, request: AgentOpen) -> None:
        import torch.distributed as dist

        self.keep_alive = request.keep_alive
        if request.serve:
            fd = self.channel.fds.pop(0) if self.channel.fds else -1
            if fd < 0:
                raise RuntimeError("asked to serve the endpoint's store, but no socket came with the request")
            self.store = dist.TCPStore(request.address, request.port, is_master=True, wait_for_workers=False,
                                       master_listen_fd=fd, timeout=timedelta(seconds=request.keep_alive))
        else:
            self.store = dist.TCPStore(request.host, request.port, is_master=False,
                                       timeout=timedelta(seconds=request.join_timeout))
        self.handler = make_handler(self.store, request)

    def form(self, request: AgentForm) -> AgentFormed:
        info = self.handler.next_rendezvous()
        node, nnodes = int(info.rank), int(info.world_size)
        self.round, self.node_rank = info.store, node
        keys = [f"ddpd/node/{n}" for n in range(nnodes)]
        self.round.set(keys[node], msgspec.json.encode(request.record))
        self.round.add(f"ddpd/hb/{node}", 1)
        self.round.wait(keys, timedelta(seconds=request.timeout))
        records = [read_record(v) for v in self.round.multi_get(keys)]
        return AgentFormed(id=request.id, node_rank=node, nnodes=nnodes, records=records)

    def poll(self, request: AgentPoll) -> AgentPolled:
        store, n = self.round, request.nnodes
        store.add(f"ddpd/hb/{request.node_rank}", 1)
        values = store.multi_get([f"ddpd/hb/{i}" for i in range(n)] + [f"ddpd/node/{i}" for i in range(n)])
        failed = None
        if store.check([FAILED_KEY]):
            failed = clip_text(bytes(store.get(FAILED_KEY))[: TEXT_LIMIT * 4].decode(errors="replace"))
        waiting = int(self.handler.num_nodes_waiting()) if request.elastic else 0
        return AgentPolled(id=request.id, beats=[read_counter(v) for v in values[:n]],
                           records=[read_record(v) for v in values[n:]], failed=failed or None,
                           waiting=max(0, min(waiting, MAX_NODES)))

    def publish(self, request: AgentPublish) -> None:
        self.round.set(f"ddpd/node/{request.node_rank}", msgspec.json.encode(request.record))
        if request.failure is not None:
            self.round.compare_set(FAILED_KEY, "", request.failure)


def read_record(value: Any) -> NodeRecord | None:
    raw = bytes(value)
    if len(raw) > RECORD_BYTES:
        return None
    try:
        return msgspec.json.decode(raw, type=NodeRecord)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None


def read_counter(value: Any) -> int | None:
    raw = bytes(value)
    if len(raw) > 32:
        return None
    try:
        return int(raw)
    except ValueError:
        return None


def make_handler(store: Any, request: AgentOpen) -> Any:
    """torch's DynamicRendezvousHandler over the c10d backend, with the job's timeouts; it never
    starts a store server of its own (the daemon's ranks serve each attempt's), and it publishes
    each round's bootstrap address in that round."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
        RendezvousTimeout,
    )

    class Handler(DynamicRendezvousHandler):  # type: ignore[misc]
        def _create_tcp_store_server(self, master_addr: Any, master_port: Any) -> Any:
            return NoServer()

        def next_rendezvous(self) -> Any:
            # torch keeps the first round's bootstrap address and publishes it only then, while a node
            # that joins a later round waits for it under that round's prefix: published every round
            self._bootstrap_store_info = None
            self._shared_tcp_store_server = None
            return super().next_rendezvous()

    backend = C10dRendezvousBackend(store, request.run_id)
    interval = max(1, round(request.keep_alive / 3))
    timeout = RendezvousTimeout(join=timedelta(seconds=request.join_timeout),
                                last_call=timedelta(seconds=request.last_call),
                                close=timedelta(seconds=CLOSE_TIMEOUT), heartbeat=timedelta(seconds=interval))
    return Handler.from_backend(request.run_id, store, backend, request.min_nodes, request.max_nodes,
                                local_addr=request.address, timeout=timeout, keep_alive_interval=interval,
                                keep_alive_max_attempt=3)


class NoServer:
    port = 0


def requests(channel: Channel) -> Any:
    """The daemon's requests as they arrive (a bad frame is reported and skipped); ends at EOF."""
    splitter = LineSplitter()
    decoder: Decoder[AgentRequest] = Decoder(AgentRequest)
    while data := channel.receive():
        for line in splitter.feed(data):
            try:
                yield decoder.decode_frame(line)
            except FrameError as exc:
                print(f"ddpd agent: ignoring bad frame from daemon: {exc}", flush=True)


def serve(sock: socket.socket, daemon_pgid: int, spawn: Callable[..., Any] = threading.Thread) -> NoReturn:
    """Answer the daemon until its channel closes; then leave."""
    channel = Channel(sock, daemon_pgid)
    agent = Agent(channel)
    try:
        for request in requests(channel):
            spawn(target=agent.handle, args=(request,), name=f"ddpd-agent-{request.id}", daemon=True).start()
    except OSError as exc:
        channel.daemon_gone(f"channel error: {exc!r}")
    print(f"ddpd agent {os.getpid()}: channel closed", flush=True)
    os._exit(0)
