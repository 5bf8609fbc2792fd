"""A multi-node job as one node's daemon shows it (issue 38): which global ranks its per-rank commands
answer for, what it says of another node's rank, and how its node table ends (each node's end as
read from the rendezvous store, "unknown" where it was not read), on a fake rendezvous agent."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence

import anyio
import pytest
from rich.console import Console

from ddpd.cli.render import job_detail
from ddpd.cli.web.context import Web
from ddpd.cli.web.data import JobDetail
from ddpd.cli.web.present import environment, job_context, log_ranks
from ddpd.daemon.multinode.elastic import NodeError
from ddpd.daemon.multinode.nodes import NodeLayout, NodeSession
from ddpd.daemon.multinode.placement import check_rank, ranks_in_memory
from ddpd.daemon.store.downsample import JobFeed
from ddpd.daemon.store.errors import NotFoundError, OtherNodeError
from ddpd.daemon.store.records import Job, Rank
from ddpd.protocol import ErrorCode, JobSpec, JobState
from ddpd.protocol.agent import AgentDone, AgentPoll, AgentPolled, AgentPublish, AgentReply, AgentRequest, NodeRecord
from ddpd.protocol.control import JobView
from ddpd.protocol.nodes import NodeView, daemon_text, elsewhere_text, local_ranks, node_of, span_text

KEEP_ALIVE = 0.5
SPEC = JobSpec(nproc=2, nnodes="2", rdzv_endpoint="10.0.0.1:29400", rdzv_id="run", rdzv_keep_alive=KEEP_ALIVE)
TABLE = [NodeView(node_rank=0, host="10.0.0.1", daemon="node-a:4242", state="running", ranks=[0, 1]),
         NodeView(node_rank=1, host="10.0.0.2", daemon="node-b:77", state="running", ranks=[2, 3], local=True)]


def job(spec: JobSpec = SPEC, nodes: list[NodeView] | None = None, ranks: Sequence[int] = (2, 3)) -> Job:
    found = Job(id="j1-abcd", seq=1, name="", owner_uid=0, spec=spec, state=JobState.RUNNING, submitted_at=0.0,
                attempt=2, nodes=list(TABLE) if nodes is None else nodes)
    found.ranks = [Rank(rank=r, attempt=2) for r in ranks]
    return found


def test_the_table_names_where_a_rank_runs() -> None:
    assert node_of(TABLE, 1) == TABLE[0] and node_of(TABLE, 3) == TABLE[1] and node_of(TABLE, 4) is None
    assert local_ranks(TABLE) == [2, 3] and local_ranks(TABLE[:1]) is None
    assert daemon_text("node-a:4242") == "daemon pid 4242 on node-a" and daemon_text("odd") == "daemon odd"
    assert elsewhere_text(0, TABLE[0]) == ("rank 0 runs on node 0 (host 10.0.0.1, daemon pid 4242 on node-a): "
                                           "ask that daemon")
    assert span_text([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8" and span_text([]) == ""


def test_a_node_answers_for_its_own_global_ranks() -> None:
    j = job()
    assert ranks_in_memory(j, 2) == [2, 3]  # the current attempt's, from memory
    assert ranks_in_memory(j, 1) is None  # an earlier one's: the journal's
    for rank in (2, 3):
        check_rank(j, rank, [2, 3])
    with pytest.raises(OtherNodeError, match=r"^rank 0 runs on node 0 \(host 10.0.0.1, daemon pid 4242") as err:
        check_rank(j, 0, [2, 3])
    assert err.value.code == ErrorCode.OTHER_NODE
    with pytest.raises(NotFoundError, match="has no rank 9: its ranks are 0-3, on 2 nodes"):
        check_rank(j, 9, [2, 3])
    check_rank(j, 3, [])  # this node's in the layout, not started yet in this attempt: a follower waits
    check_rank(job(nodes=[], ranks=()), 7, [])  # the nodes have not formed: which ranks run here is not known


def test_a_single_node_job_is_as_before() -> None:
    single = job(spec=JobSpec(nproc=2), nodes=[], ranks=(0, 1))
    assert ranks_in_memory(single, 1) == [0, 1]  # every attempt: 0..nproc-1
    check_rank(single, 1, [0, 1])
    with pytest.raises(NotFoundError, match=r"has no rank 2$"):
        check_rank(single, 2, [0, 1])


def test_status_and_the_web_page_say_which_ranks_this_daemon_shows() -> None:
    view = JobView(id="j1", name="", state="SUCCEEDED", owner_uid=0, submitted_at=0.0, spec=SPEC, nodes=[
        TABLE[0], NodeView(node_rank=1, host="10.0.0.2", daemon="node-b:77", state="unknown",
                                      ranks=[2, 3], local=True)])
    console = Console(width=140, record=True)
    console.print(job_detail(view, 0.0))
    text = console.export_text()
    assert "unknown" in text and "1*" in text and "logs and stacks here: ranks 2-3" in text, text
    assert log_ranks(view) == [2, 3]
    web = Web(client=None, hub=None, token="t", env=environment(), viewer=0)  # type: ignore[arg-type]
    page = web.render("job.html", **job_context(JobDetail(view, None), 1.0, 0))
    assert re.findall(r'<option value="(\d*)"', page) == ["", "2", "3"]  # the log view: all, or this node's
    assert '<span class="state s-unknown">unknown</span>' in page and "10.0.0.1" in page
    assert log_ranks(JobView(id="j2", name="", state="RUNNING", owner_uid=0, submitted_at=0.0,
                             spec=JobSpec(nproc=3))) == [0, 1, 2]


class FakeAgent:
    """The job's rendezvous agent as NodeSession asks it: each poll answered by `answer` (its count)."""

    def __init__(self, answer: Callable[[int], tuple[list[int | None], list[NodeRecord | None]]]) -> None:
        self.answer = answer
        self.polls = 0
        self.published: list[str] = []
        self.closed = False
        self.ids = 0

    def next_id(self) -> int:
        self.ids += 1
        return self.ids

    async def call(self, request: AgentRequest, timeout: float, fds: Sequence[int] = ()) -> AgentReply:
        if isinstance(request, AgentPoll):
            self.polls += 1
            beats, records = self.answer(self.polls)
            return AgentPolled(id=request.id, beats=beats, records=records)
        if isinstance(request, AgentPublish):
            self.published.append(request.record.state)
        return AgentDone(id=request.id)

    async def close(self) -> None:
        self.closed = True


def record(host: str, state: str) -> NodeRecord:
    return NodeRecord(host=host, daemon=f"{host}:1", nproc=2, state=state)


def session(node_rank: int, agent: FakeAgent, serving: bool, peer: str = "running") -> NodeSession:
    """This node (`node_rank` of 2) at its job's end, the other node last seen `peer`."""
    s = NodeSession(SPEC, None, 5.0, daemon="here:1")
    s.agent = agent  # type: ignore[assignment]  # the fake stands in for RendezvousAgent
    s.serving, s.formed, s.address = serving, True, f"10.0.0.{node_rank + 1}"
    s.layout = NodeLayout(node_rank, 2, 2 * node_rank, 4, "run", 0)
    other = 1 - node_rank
    s.records = {node_rank: record(s.address, "running"), other: record(f"10.0.0.{other + 1}", peer)}
    return s


async def closed(s: NodeSession, state: str = "succeeded") -> dict[int, str]:
    with anyio.fail_after(5):
        await s.close(state)
    return {n.node_rank: n.state for n in s.nodes}


@pytest.mark.anyio
async def test_a_node_reads_how_the_other_ended() -> None:
    """Bug: the second node showed the first as `running` after both had succeeded."""
    agent = FakeAgent(lambda n: ([3, n], [record("10.0.0.1", "running" if n < 2 else "succeeded"),
                                          record("10.0.0.2", "succeeded")]))
    s = session(1, agent, serving=False)
    assert await closed(s) == {0: "succeeded", 1: "succeeded"}
    assert agent.published == ["succeeded"] and agent.closed
    assert agent.polls == 2 + 2  # until it saw every end, then twice more: the serving node waits for a beat


@pytest.mark.anyio
async def test_a_node_it_could_not_read_is_unknown() -> None:
    class Gone(FakeAgent):
        async def call(self, request: AgentRequest, timeout: float, fds: Sequence[int] = ()) -> AgentReply:
            if isinstance(request, AgentPoll):
                raise NodeError("the store is gone")
            return await super().call(request, timeout, fds)

    s = session(1, Gone(lambda n: ([], [])), serving=False)
    started = time.monotonic()
    assert await closed(s) == {0: "unknown", 1: "succeeded"}  # never the stale `running`
    assert time.monotonic() - started < KEEP_ALIVE  # a store that does not answer is not waited on
    stopped = session(1, Gone(lambda n: ([], [])), serving=False, peer="failed")
    assert await closed(stopped, "cancelled") == {0: "failed", 1: "cancelled"}  # an end read before stays


@pytest.mark.anyio
async def test_the_serving_node_keeps_the_store_until_the_others_read_the_ends() -> None:
    """The peer ended already; its heartbeat moves at the serving node's 3rd read: the store stays up
    until then (the peer's read after all had ended), and no longer."""
    def answer(n: int) -> tuple[list[int | None], list[NodeRecord | None]]:
        return [n, 10 if n < 3 else 11], [record("10.0.0.1", "succeeded"), record("10.0.0.2", "succeeded")]

    agent = FakeAgent(answer)
    assert await closed(session(0, agent, serving=True, peer="succeeded")) == {0: "succeeded", 1: "succeeded"}
    assert agent.polls == 3
    never = FakeAgent(lambda n: ([n, 10], [record("10.0.0.1", "succeeded"), record("10.0.0.2", "succeeded")]))
    started = time.monotonic()
    assert await closed(session(0, never, serving=True, peer="succeeded")) == {0: "succeeded", 1: "succeeded"}
    assert KEEP_ALIVE <= time.monotonic() - started < KEEP_ALIVE + 1  # bounded


@pytest.mark.anyio
async def test_a_node_found_lost_stays_lost_in_the_table() -> None:
    """A cut link: the node's record in the store still says `running` (it could not write again);
    the watch found it lost, and the table keeps `lost` through the last reads."""
    agent = FakeAgent(lambda n: ([n, 10], [record("10.0.0.1", "failed"), record("10.0.0.2", "running")]))
    s = session(0, agent, serving=True)
    s.records[1].state = "lost"  # NodeSession.mark, on the watch's verdict
    assert await closed(s, "failed") == {0: "failed", 1: "lost"}
    assert agent.polls == 1  # and the store is not kept up for a node that reads nothing more


def test_a_nodes_curve_is_led_by_its_lowest_global_rank() -> None:
    """Node 1 of a 2 x 2 job feeds its curve with ranks 2 and 3 only: a point per step, their mean."""
    feed = JobFeed()
    assert not feed.report(1.0, 1, 2, step=1, loss=1.0)
    assert not feed.report(1.1, 1, 3, step=1, loss=3.0)
    assert feed.report(2.0, 1, 2, step=2, loss=2.0)
    assert [(b.step, b.loss) for b in feed.curve.buckets] == [(1, 2.0)]
