"""Messages between a daemon and a multi-node job's rendezvous agent (``ddpd.worker --agent``).

The agent is a process of the job's user that runs torch's elastic rendezvous for the job on this
node (the ``DynamicRendezvousHandler``, which unpickles its store's state, and, on the endpoint's
host, the endpoint's TCPStore on the socket the daemon bound: it comes with `AgentOpen`,
SCM_RIGHTS). The daemon asks (`AgentRequest`, each with an id) and the agent answers with the
same id (`AgentReply`): plain, typed, bounded data the daemon validates, never a pickle and never
torch's state. Everything in a reply may have been written into the store by another machine or a
hostile process: the bounds here hold whatever it wrote.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from .limits import TEXT_LIMIT
from .nodes import MAX_NODES, MAX_RUN_ID
from .spec import MAX_NPROC

RequestId = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
NodeRank = Annotated[int, msgspec.Meta(ge=0, lt=MAX_NODES)]
Seconds = Annotated[float, msgspec.Meta(gt=0, le=86400 * 7)]
Host = Annotated[str, msgspec.Meta(max_length=255)]


class NodeRecord(msgspec.Struct, forbid_unknown_fields=True):
    """What each node's daemon writes about itself in the round's store (read back typed and bounded)."""

    host: Host
    daemon: Annotated[str, msgspec.Meta(max_length=300)]
    nproc: Annotated[int, msgspec.Meta(ge=0, le=MAX_NPROC)]
    state: Annotated[str, msgspec.Meta(max_length=32)]


class _A(msgspec.Struct, tag_field="type", forbid_unknown_fields=True):
    id: RequestId


# daemon -> agent


class AgentOpen(_A, tag="open"):
    """Open the job's rendezvous: serve the endpoint's store (`serve`: its listening socket comes with
    this frame) or connect to it; then build torch's handler for `run_id`."""

    run_id: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_RUN_ID)]
    host: Host
    port: Annotated[int, msgspec.Meta(ge=1, le=65535)]
    address: Host  # this node's address (what the others reach it at)
    serve: bool
    min_nodes: Annotated[int, msgspec.Meta(ge=1, le=MAX_NODES)]
    max_nodes: Annotated[int, msgspec.Meta(ge=1, le=MAX_NODES)]
    join_timeout: Seconds
    last_call: Annotated[float, msgspec.Meta(ge=0, le=86400)]
    keep_alive: Seconds


class AgentForm(_A, tag="form"):
    """Join the next round, publish this node's record and read every node's."""

    record: NodeRecord
    timeout: Seconds


class AgentSetMaster(_A, tag="set_master"):
    """Node rank 0: publish the attempt's worker store address (HOST:PORT) in the round."""

    address: Annotated[str, msgspec.Meta(max_length=300)]


class AgentGetMaster(_A, tag="get_master"):
    """Another node: wait for node rank 0's worker store address."""

    timeout: Seconds


class AgentPoll(_A, tag="poll"):
    """Count this node's heartbeat; read the others', their records, a written failure, and (an
    elastic job) how many nodes wait to join."""

    node_rank: NodeRank
    nnodes: Annotated[int, msgspec.Meta(ge=1, le=MAX_NODES)]
    elastic: bool


class AgentPublish(_A, tag="publish"):
    """Write this node's record (and the attempt's root cause: the first one written wins)."""

    node_rank: NodeRank
    record: NodeRecord
    failure: Annotated[str, msgspec.Meta(max_length=TEXT_LIMIT)] | None = None


class AgentShutdown(_A, tag="shutdown"):
    """The job ended here: close the rendezvous (torchrun's shutdown)."""


AgentRequest = AgentOpen | AgentForm | AgentSetMaster | AgentGetMaster | AgentPoll | AgentPublish | AgentShutdown


# agent -> daemon


class AgentDone(_A, tag="done"):
    pass


class AgentFormed(_A, tag="formed"):
    node_rank: NodeRank
    nnodes: Annotated[int, msgspec.Meta(ge=1, le=MAX_NODES)]
    records: Annotated[list[NodeRecord | None], msgspec.Meta(max_length=MAX_NODES)]  # None: unreadable


class AgentMaster(_A, tag="master"):
    address: Annotated[str, msgspec.Meta(max_length=300)]


class AgentPolled(_A, tag="polled"):
    beats: Annotated[list[int | None], msgspec.Meta(max_length=MAX_NODES)]  # None: not a counter
    records: Annotated[list[NodeRecord | None], msgspec.Meta(max_length=MAX_NODES)]
    failed: Annotated[str, msgspec.Meta(max_length=TEXT_LIMIT)] | None = None
    waiting: Annotated[int, msgspec.Meta(ge=0, le=MAX_NODES)] = 0


class AgentError(_A, tag="error"):
    """The request failed (`kind`: timeout, store, rendezvous, bad_request)."""

    kind: Annotated[str, msgspec.Meta(max_length=32)]
    message: Annotated[str, msgspec.Meta(max_length=TEXT_LIMIT)]


AgentReply = AgentDone | AgentFormed | AgentMaster | AgentPolled | AgentError
