"""Multi-node pure logic: the spec's rendezvous fields, the global rank layout, the lost-node decision
on a fake clock, and each rank's environment across nodes."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from rich.console import Console

from ddpd.cli.render import job_detail
from ddpd.cli.specs import spec_from_options
from ddpd.daemon.attempt.launch import rank_env
from ddpd.daemon.multinode.elastic import Endpoint, NodeError, check_endpoint, locate_endpoint
from ddpd.daemon.multinode.multinode import own_fault
from ddpd.daemon.multinode.nodes import NodeLayout
from ddpd.daemon.multinode.nodewatch import NodeWatch, Verdict
from ddpd.daemon.run.rendezvous import Rendezvous
from ddpd.daemon.store.records import Job
from ddpd.protocol import JobSpec, JobState, SpecError, check_spec
from ddpd.protocol.control import JobView, RootCause
from ddpd.protocol.nodes import NodeView, parse_endpoint, parse_nnodes, rank_layout


@pytest.mark.parametrize(("text", "expected"), [("1", (1, 1)), ("2", (2, 2)), ("1:4", (1, 4)), (" 2:2 ", (2, 2))])
def test_nnodes_parses(text: str, expected: tuple[int, int]) -> None:
    assert parse_nnodes(text) == expected


@pytest.mark.parametrize("text", ["", "0", "3:2", "a", "1:", ":2", "1:2:3", "1:100000", "-1:2"])
def test_bad_nnodes_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match=r"MIN|nodes"):
        parse_nnodes(text)


@pytest.mark.parametrize(("text", "expected"), [
    ("10.0.0.1:29400", ("10.0.0.1", 29400)), ("node-a.cluster:1", ("node-a.cluster", 1)),
    ("[fe80::1]:29400", ("fe80::1", 29400)),
])
def test_endpoint_parses(text: str, expected: tuple[str, int]) -> None:
    assert parse_endpoint(text) == expected


@pytest.mark.parametrize("text", ["host", "host:", ":29400", "host:0", "host:65536", "host:x", "a b:1", "[::1]",
                                  "ho\nst:1", "-host:1"])
def test_bad_endpoint_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match=r"expected|port|host"):
        parse_endpoint(text)


def test_spec_errors_name_the_field() -> None:
    with pytest.raises(SpecError) as err:
        check_spec(JobSpec(nnodes="2"))
    assert err.value.field == "rdzv_endpoint"
    with pytest.raises(SpecError) as err:
        check_spec(JobSpec(nnodes="2:1", rdzv_endpoint="h:1", rdzv_id="r"))
    assert err.value.field == "nnodes"
    with pytest.raises(SpecError) as err:
        check_spec(JobSpec(nnodes="2", rdzv_endpoint="h:99999", rdzv_id="r"))
    assert err.value.field == "rdzv_endpoint"
    with pytest.raises(SpecError) as err:
        check_spec(JobSpec(nnodes="2", rdzv_endpoint="h:1", rdzv_id="bad id"))
    assert err.value.field == "rdzv_id"
    assert check_spec(JobSpec(nnodes="1:2", rdzv_endpoint="h:1", rdzv_id="r")).nnodes == "1:2"
    assert check_spec(JobSpec()).rdzv_endpoint == ""  # one node: the single-node path


def test_ranks_follow_torchrun_layout() -> None:
    assert rank_layout([2, 2], 0) == (0, 4)
    assert rank_layout([2, 2], 1) == (2, 4)
    assert rank_layout([4, 1, 3], 2) == (5, 8)
    with pytest.raises(ValueError, match="outside"):
        rank_layout([2], 1)


def test_rank_environment_across_nodes() -> None:
    job = Job(id="j1", seq=1, name="n", owner_uid=0, spec=JobSpec(nproc=2, max_restarts=3), state=JobState.STARTING,
              submitted_at=0.0)
    layout = NodeLayout(node_rank=1, nnodes=2, offset=2, world_size=4, run_id="run", restart_count=1)
    env = rank_env({}, job, 3, 1, Rendezvous("10.0.0.1", 4000, None), "m", Path("/e"), layout=layout)
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR",
                                "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")} == {
        "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "2", "ROLE_RANK": "3", "ROLE_WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.1",
        "TORCHELASTIC_RUN_ID": "run", "TORCHELASTIC_RESTART_COUNT": "1"}


def test_a_silent_node_is_lost_after_keep_alive_on_our_clock() -> None:
    watch = NodeWatch(keep_alive=3.0, peers=[1, 2], started=100.0)
    for t in (100.5, 101.5, 102.5):
        watch.answered(t)
        watch.beat(1, int(t), t)  # node 1 counts on
        watch.beat(2, 7, t)  # node 2's counter stopped at 7 (first read at 100.5)
    assert watch.verdict(103.4) is None
    watch.answered(103.5)
    assert watch.verdict(103.5) == Verdict("lost", node=2)


def test_a_store_that_stops_answering_is_unreachable() -> None:
    watch = NodeWatch(keep_alive=2.0, peers=[0], started=0.0)
    watch.answered(1.0)
    watch.beat(0, 1, 1.0)
    assert watch.verdict(2.9) is None
    assert watch.verdict(3.0) == Verdict("unreachable")


def test_a_cut_link_reads_unreachable_not_a_lost_peer() -> None:
    """Bug (a cut link, in CI): node 0's counter last moved at 1.0 and the last read answered at 1.9;
    from 4.0 on, before the store's silence reached keep_alive (4.9), the peer read as lost."""
    watch = NodeWatch(keep_alive=3.0, peers=[0], started=0.0)
    watch.answered(1.0)
    watch.beat(0, 5, 1.0)
    watch.answered(1.9)
    watch.beat(0, 5, 1.9)  # node 0 beats once a second: not yet again
    assert watch.verdict(4.5) is None  # the link is cut: nothing answers, nothing is known of node 0
    assert watch.verdict(4.9) == Verdict("unreachable")


def test_a_written_failure_wins() -> None:
    watch = NodeWatch(keep_alive=2.0, peers=[0], started=0.0)
    watch.failed("node 0 (host a) failed: rank 1 died of signal SIGKILL")
    watch.failed("a later one")
    assert watch.verdict(0.1) == Verdict("failed", detail="node 0 (host a) failed: rank 1 died of signal SIGKILL")


def test_the_endpoint_port_is_checked_where_it_is_served() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(NodeError, match=f"port {port} on 127.0.0.1 is taken"):
            check_endpoint(JobSpec(nnodes="2", rdzv_endpoint=f"127.0.0.1:{port}", rdzv_id="r"))
    assert locate_endpoint("127.0.0.1", port) == Endpoint("127.0.0.1")  # free again: this daemon would serve it
    with pytest.raises(NodeError, match="port 1 is privileged"):
        check_endpoint(JobSpec(nnodes="2", rdzv_endpoint="127.0.0.1:1", rdzv_id="r"), owner_uid=1000)
    assert locate_endpoint("192.0.2.1", port) == Endpoint(None)  # not an address of this machine: a client


def test_submit_flags_and_status_speak_torchrun(tmp_path: Path) -> None:
    spec = spec_from_options({"nproc": 2, "nnodes": "1:2", "rdzv_endpoint": "h:29400", "rdzv_id": "run",
                              "rdzv_keep_alive": 5.0}, ())
    assert (spec.nnodes, spec.rdzv_endpoint, spec.rdzv_id, spec.rdzv_keep_alive) == ("1:2", "h:29400", "run", 5.0)
    view = JobView(id="j1", name="", state="FAILED", owner_uid=0, submitted_at=0.0, spec=spec, nodes=[
        NodeView(node_rank=0, host="10.0.0.1", daemon="a:1", state="failed", ranks=[0, 1], local=True),
        NodeView(node_rank=1, host="10.0.0.2", daemon="b:2", state="lost", ranks=[2, 3])])
    console = Console(width=120, record=True)
    console.print(job_detail(view, 0.0))
    text = console.export_text()
    assert "0*" in text and "10.0.0.2" in text and "lost" in text and "2-3" in text


def test_only_a_nodes_own_failure_is_published_as_the_root_cause() -> None:
    killed = RootCause(reason="rank_failed", rank=3, signal="SIGKILL", detail="rank 3 died of signal SIGKILL")
    own = RootCause(reason="rank_failed", rank=2, error="ValueError", message="bad batch")
    peers_gone = RootCause(reason="rank_failed", rank=2, error="DistBackendError", message="Connection closed by peer")
    assert own_fault(killed) and own_fault(own)
    assert not own_fault(peers_gone) and not own_fault(None)
    assert not own_fault(RootCause(reason="node_lost", detail="node 1 (host b) lost"))
