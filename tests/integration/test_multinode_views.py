"""A multi-node job as seen from every node (issue 38): two daemons as two nodes, on one host (the
torchrun recipe: both on 127.0.0.1) and in network namespaces of their own (see netns).

On each node, every per-rank command addresses ranks by their global rank, as `status` lists them,
and shows that node's ranks: `ddpctl logs` (all, `--rank`, `-f` during the run, `--since`,
`--tail`, `--stream`), `ddpctl stacks` (all, `--rank`) and the same through the Python client. A
rank of the other node gets `other_node`, naming the node, its host and its daemon's pid. Once the
job ended, each node's table shows both nodes' final states. Bug: on the second node `ddpctl logs
JOB` printed nothing, `--rank 2` answered `not_found`, and each node showed the other as `running`
after both had succeeded.

The script (`tests/scripts/node_lines.py`) holds its ranks at a gate file, so the test decides when
they go on: no sleep orders anything here.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.abc import Process

from ddpd.client import LogChunk, RemoteError
from ddpd.protocol.control import JobView
from ddpd.protocol.nodes import NodeView
from tests.conftest import REPO, DaemonProc, assert_nothing_left, running_daemon

from .netns import LINK, unavailable
from .test_cli import DDPCTL, ddpctl, err, out
from .test_multinode import PORTS, two_daemons

pytestmark = pytest.mark.anyio

KEEP_ALIVE = 3.0
TIMEOUT = 120
SCRIPT = "tests/scripts/node_lines.py"
SCRIPT_LINE = re.compile(r"^(out |err )?rank \d+( |$)")  # what the script writes (torch may warn beside it)


@dataclass
class Node:
    """One node's daemon and its part of the job."""

    d: DaemonProc
    job: str
    ranks: list[int]  # its global ranks, as its status lists them
    table: list[NodeView]  # its view of the job's nodes while running


def free_port() -> int:
    """A port free on 127.0.0.1 now (the endpoint of the one-host test)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def at_gate(node: Node) -> None:
    """Every rank of the node is at its gate: its line read through a following `logs` stream."""
    seen: set[int] = set()
    with anyio.fail_after(60):
        async with node.d.client.logs(node.job, follow=True, stream="stdout") as chunks:
            async for chunk in chunks:
                if "waiting for gate" in chunk.text:
                    seen.add(chunk.rank)
                if seen == set(node.ranks):
                    return
    raise AssertionError(f"the logs stream of {node.job} ended before ranks {node.ranks} reached the gate: {seen}")


async def follower(d: DaemonProc, job: str, output: dict[str, bytes], tg: anyio.abc.TaskGroup) -> Process:
    """`ddpctl logs JOB -f`, started now and read until it exits (when the job ends)."""
    proc = await anyio.open_process([DDPCTL, "--socket", str(d.socket), "logs", job, "-f"], cwd=str(REPO),
                                    stdin=subprocess.DEVNULL, stderr=subprocess.STDOUT)

    async def read() -> None:
        assert proc.stdout is not None
        data = b""
        async for part in proc.stdout:
            data += part
        output[job] = data

    tg.start_soon(read)
    return proc


def elsewhere_text(rank: int, home: NodeView) -> str:
    """What a node says of a rank its peer `home` runs (home as the peer describes itself)."""
    pid = home.daemon.rpartition(":")[2]
    return f"rank {rank} runs on node {home.node_rank} (host {home.host}, daemon pid {pid}"


def lines_of(node: Node, world: int, sums: bool = True) -> dict[int, list[str]]:
    """Each of the node's ranks' lines, both streams, in the order the rank wrote them."""
    group = next(n.node_rank for n in node.table if n.local)
    return {r: [f"out rank {r} of {world} group_rank {group}", f"err rank {r}", f"rank {r} waiting for gate",
                *([f"rank {r} sum {world * (world + 1) // 2}"] if sums else [])] for r in node.ranks}


async def iterate(stream: Any) -> AsyncIterator[LogChunk]:
    async with stream as chunks:
        async for chunk in chunks:
            yield chunk


async def read_logs(node: Node, **query: Any) -> dict[int, str]:
    """The node's logs through the Python client, by rank."""
    got: dict[int, str] = {}
    async with node.d.client.logs(node.job, **query) as chunks:
        async for chunk in chunks:
            got[chunk.rank] = got.get(chunk.rank, "") + chunk.text
    return got


def by_rank(text: str) -> dict[int, tuple[list[str], list[str]]]:
    """`[rank R] line` lines of ddpctl's output, by rank: (its stdout lines, its stderr lines), each in
    order (the two streams are merged by the time the daemon received them, not by the rank's writes)."""
    found: dict[int, list[str]] = {}
    for line in text.splitlines():
        head, sep, rest = line.partition("] ")
        assert sep and head.startswith("[rank "), line
        found.setdefault(int(head.removeprefix("[rank ")), []).append(rest)
    return {r: streams(lines) for r, lines in found.items()}


def streams(lines: list[str]) -> tuple[list[str], list[str]]:
    """The script's lines (not torch's warnings) as (stdout's, stderr's)."""
    ours = [x for x in lines if SCRIPT_LINE.match(x)]
    return [x for x in ours if not x.startswith("err ")], [x for x in ours if x.startswith("err ")]


async def each_node_shows_its_ranks(tmp: Path, a: DaemonProc, b: DaemonProc, host: str, port: int,
                                    env: dict[str, str]) -> None:
    gate = tmp / "gate"
    spec: dict[str, Any] = {"script": [SCRIPT, str(gate)], "nnodes": "2", "nproc": 2, "rdzv_id": f"views-{port}",
                            "rdzv_endpoint": f"{host}:{port}", "rdzv_keep_alive": KEEP_ALIVE, "env": env}
    jobs = [await d.client.submit(d.spec(**spec)) for d in (a, b)]
    followed: dict[str, bytes] = {}
    async with anyio.create_task_group() as tg:
        follows = [await follower(d, j, followed, tg) for d, j in zip((a, b), jobs, strict=True)]
        for d, j in zip((a, b), jobs, strict=True):
            await d.wait_event(j, lambda e: e.kind == "job.state_changed" and e.data.get("to") == "RUNNING")
        nodes = []
        for d, j in zip((a, b), jobs, strict=True):
            view = await d.client.status(j)
            nodes.append(Node(d, j, sorted(r.rank for r in view.ranks), view.nodes))
        assert sorted(nodes[0].ranks + nodes[1].ranks) == [0, 1, 2, 3]
        for node in nodes:
            assert next(n.ranks for n in node.table if n.local) == node.ranks
            await at_gate(node)

        for node, peer in (nodes, nodes[::-1]):
            home = next(n for n in peer.table if n.local)  # the peer as it describes itself
            # ddpctl stacks: this node's ranks, each in the script's wait
            done = await ddpctl(node.d, "stacks", node.job, "-o", "json")
            assert done.returncode == 0, err(done)
            result = json.loads(out(done))
            assert sorted(r["rank"] for r in result["ranks"] if r["answered"]) == node.ranks, result
            waiting = [g for g in result["groups"] if g.get("main") and "wait_for" in g["stack"]]
            assert sorted(r for g in waiting for r in g["ranks"]) == node.ranks, result["groups"]
            done = await ddpctl(node.d, "stacks", node.job, "--rank", str(node.ranks[-1]))
            assert done.returncode == 0 and "wait_for" in out(done), err(done)
            assert f"== rank {node.ranks[-1]} · thread MainThread ==" in out(done), out(done)
            done = await ddpctl(node.d, "stacks", node.job, "--rank", str(peer.ranks[0]))
            assert done.returncode == 1, out(done)
            assert f"other_node: {elsewhere_text(peer.ranks[0], home)}" in err(done), err(done)
            assert "ask that daemon" in err(done), err(done)
            # the Python client: the same
            one = await node.d.client.stacks(node.job, rank=node.ranks[0])
            assert [r.rank for r in one.ranks] == [node.ranks[0]] and one.ranks[0].answered, one
            with pytest.raises(RemoteError) as raised:
                await node.d.client.stacks(node.job, rank=peer.ranks[-1])
            assert raised.value.code == "other_node", raised.value
            assert elsewhere_text(peer.ranks[-1], home) in raised.value.message, raised.value
            # logs --rank during the run, through ddpctl
            done = await ddpctl(node.d, "logs", node.job, "--rank", str(node.ranks[0]), "--stream", "stdout")
            assert done.returncode == 0, err(done)
            stdout = streams(lines_of(node, 4, sums=False)[node.ranks[0]])[0]
            assert streams(out(done).splitlines()) == (stdout, []), out(done)

        gate.touch()
        views: list[JobView] = []
        with anyio.fail_after(TIMEOUT):
            for node in nodes:
                views.append(await node.d.client.wait(node.job))
            for proc in follows:
                assert await proc.wait() == 0
    assert [v.state for v in views] == ["SUCCEEDED", "SUCCEEDED"], [v.root_cause for v in views]

    for node, peer, view in zip(nodes, nodes[::-1], views, strict=True):
        expected = lines_of(node, 4)
        split = {r: streams(lines) for r, lines in expected.items()}
        home = next(n for n in peer.table if n.local)
        # the node table: both nodes' final states, on each node (no stale `running`)
        assert [(n.node_rank, n.state, n.local) for n in view.nodes] == [
            (n.node_rank, "succeeded", n.local) for n in node.table], view.nodes
        done = await ddpctl(node.d, "status", node.job, "-o", "json")
        assert [n["state"] for n in json.loads(out(done))["nodes"]] == ["succeeded", "succeeded"], out(done)
        # ddpctl logs: all of this node's ranks, and only them
        assert by_rank(followed[node.job].decode()) == split, followed[node.job]
        done = await ddpctl(node.d, "logs", node.job)
        assert done.returncode == 0 and by_rank(out(done)) == split, (out(done), err(done))
        for r in node.ranks:
            done = await ddpctl(node.d, "logs", node.job, "--rank", str(r))
            assert done.returncode == 0 and streams(out(done).splitlines()) == split[r], (out(done), err(done))
        done = await ddpctl(node.d, "logs", node.job, "--stream", "stderr")
        assert by_rank(out(done)) == {r: ([], [f"err rank {r}"]) for r in node.ranks}, out(done)
        done = await ddpctl(node.d, "logs", node.job, "--tail", "1", "--stream", "stdout")
        assert by_rank(out(done)) == {r: ([expected[r][-1]], []) for r in node.ranks}, out(done)
        # --since: from the first line after the gate, by the daemon's stamps (a stamp is within a tick
        # of when the line came: the lines before may share it)
        stamped = [c async for c in iterate(node.d.client.logs(node.job))]
        first = min(c.time or 0.0 for c in stamped if " sum " in c.text)
        after = "".join(f"[rank {c.rank}] {line}\n" for c in stamped if (c.time or 0.0) >= first
                        for line in c.text.splitlines())
        since = datetime.fromtimestamp(first - 0.0005, UTC).isoformat()  # chunk times are rounded to the ms
        done = await ddpctl(node.d, "logs", node.job, "--since", since)
        assert by_rank(out(done)) == by_rank(after), (out(done), after)
        assert all(lines[0][-1] == expected[r][-1] for r, lines in by_rank(out(done)).items()), out(done)
        assert sorted(by_rank(out(done))) == node.ranks, out(done)
        done = await ddpctl(node.d, "logs", node.job, "--rank", ",".join(map(str, peer.ranks)))
        assert done.returncode == 1 and elsewhere_text(peer.ranks[0], home) in err(done), err(done)
        done = await ddpctl(node.d, "logs", node.job, "--rank", "7")
        assert done.returncode == 1 and "not_found" in err(done) and "0-3" in err(done), err(done)
        # the Python client: the same
        got = await read_logs(node, ranks=node.ranks)
        assert {r: streams(t.splitlines()) for r, t in got.items()} == split, got
        assert await read_logs(node) == got
        with pytest.raises(RemoteError) as raised:
            await read_logs(node, rank=peer.ranks[0])
        assert raised.value.code == "other_node" and elsewhere_text(peer.ranks[0], home) in raised.value.message
    assert_nothing_left(views)


async def test_two_nodes_on_one_host_each_show_their_own_ranks(short_tmp: Path) -> None:
    """torchrun's one-host recipe: two daemons on 127.0.0.1 (one serves the rendezvous, the other joins
    it); each node's logs, stacks and node table as the module docstring says."""
    (short_tmp / "a").mkdir()
    (short_tmp / "b").mkdir()
    async with running_daemon(short_tmp / "a") as a, running_daemon(short_tmp / "b") as b:
        await each_node_shows_its_ranks(short_tmp, a, b, "127.0.0.1", free_port(), {})


@pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))
async def test_two_nodes_in_namespaces_each_show_their_own_ranks(short_tmp: Path) -> None:
    """The same across two network namespaces (node a's address is the endpoint)."""
    async with two_daemons(short_tmp) as (nodes, a, b):
        await each_node_shows_its_ranks(short_tmp, a, b, nodes[0].address, next(PORTS), {"GLOO_SOCKET_IFNAME": LINK})
