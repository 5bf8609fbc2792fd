"""Multi-node jobs: two daemons on this machine as two nodes, each in a network namespace of its own.

The nodes are joined by a veth pair (10.77.0.1 and 10.77.0.2, see netns); each daemon has its own
socket and state directory and runs under `ip netns exec`. The daemon of node a serves the
rendezvous (the endpoint is its address). Every test proves afterwards that nothing of its jobs is
left on either node.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from ddpd.protocol.control import JobView
from tests.conftest import REPO, DaemonProc, assert_nothing_left, running_daemon, start_daemon
from tests.faults.helpers import events_of, wait_gone

from .netns import LINK, Node, two_nodes, unavailable
from .test_pool import pool_can_give, pool_full

pytestmark = [pytest.mark.anyio, pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))]

PORTS = itertools.count(29400 + os.getpid() % 500)
KEEP_ALIVE = 3.0
GRACE = 2.0
TORCHRUN = Path(sys.executable).with_name("torchrun")
ENV_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
            "ROLE_WORLD_SIZE", "ROLE_NAME", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
            "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE")


@asynccontextmanager
async def two_daemons(base: Path, *flags: str) -> AsyncIterator[tuple[tuple[Node, Node], DaemonProc, DaemonProc]]:
    with two_nodes() as nodes:
        (base / "a").mkdir()
        (base / "b").mkdir()
        async with running_daemon(base / "a", *flags, prefix=nodes[0].prefix) as a, \
                running_daemon(base / "b", *flags, prefix=nodes[1].prefix) as b:
            yield nodes, a, b


def multinode(d: DaemonProc, nodes: tuple[Node, Node], run: str, port: int, **kw: Any) -> Any:
    kw.setdefault("nnodes", "2")
    kw.setdefault("nproc", 2)
    return d.spec(rdzv_endpoint=f"{nodes[0].address}:{port}", rdzv_id=run, rdzv_keep_alive=KEEP_ALIVE,
                  env={"GLOO_SOCKET_IFNAME": LINK}, **kw)


async def wait_both(a: DaemonProc, ja: str, b: DaemonProc, jb: str, timeout: float = 120) -> tuple[JobView, JobView]:
    try:
        with anyio.fail_after(timeout):
            return await a.client.wait(ja), await b.client.wait(jb)
    except TimeoutError:
        for d, j in ((a, ja), (b, jb)):  # what each node saw, for the failure's report
            print(await d.client.status(j))
            print([(e.kind, e.attempt, e.data) for e in await events_of(d, j)][-15:])
            print([line for line in d.logs if line.get("event", "").startswith(("nodes.", "job."))][-10:])
        raise


def logged_env(view: JobView) -> dict[int, dict[str, str]]:
    """Each rank's environment as show_env.py printed it in its log."""
    found = {}
    for rank in view.ranks:
        assert rank.log is not None
        for line in Path(rank.log).read_text().splitlines():
            if line.startswith("ddpd-test-env "):
                found[rank.rank] = json.loads(line.removeprefix("ddpd-test-env "))["env"]
    return found


async def torchrun_env(nodes: tuple[Node, Node], tmp: Path, port: int) -> dict[int, dict[str, str]]:
    """The same two nodes under the installed torchrun: each rank's environment, by global rank."""
    procs = []
    for i, node in enumerate(nodes):
        log_dir = tmp / f"torchrun-{i}"
        argv = [*node.prefix, str(TORCHRUN), "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{nodes[0].address}:{port}", "--rdzv-id", "same-run", "--log-dir", str(log_dir),
                # in a namespace torchrun cannot tell its host by the machine's hostname: told here
                "--local-addr", node.address, "--rdzv-conf", f"is_host={int(i == 0)}",
                "--tee", "3", "tests/scripts/show_env.py"]
        procs.append(await anyio.open_process(argv, cwd=REPO, env={**os.environ, "GLOO_SOCKET_IFNAME": LINK},
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    with anyio.fail_after(120):
        codes = [await p.wait() for p in procs]
    assert codes == [0, 0]
    found = {}
    for i in range(2):
        for path in (tmp / f"torchrun-{i}").rglob("stdout.log"):
            for line in path.read_text().splitlines():
                if "ddpd-test-env " in line:
                    env = json.loads(line.split("ddpd-test-env ", 1)[1])["env"]
                    found[int(env["RANK"])] = env
    return found


async def test_two_nodes_train_one_world_as_torchrun(short_tmp: Path) -> None:
    """2 nodes x 2 ranks: the two-layer job succeeds in one world of 4 with the same parameters on
    every rank, its ranks taken from each node's warm pool; a script's environment matches torchrun's
    across the same two nodes; each node's status shows both nodes."""
    async with two_daemons(short_tmp, "--pool-size", "2") as (nodes, a, b):
        await pool_full(a)
        await pool_full(b)
        port = next(PORTS)
        ja = await a.client.submit(multinode(a, nodes, "train", port, steps=20))
        jb = await b.client.submit(multinode(b, nodes, "train", port, steps=20))
        va, vb = await wait_both(a, ja, b, jb)
        assert (va.state, vb.state) == ("SUCCEEDED", "SUCCEEDED"), (va.root_cause, vb.root_cause)
        assert sorted(r.rank for r in va.ranks + vb.ranks) == [0, 1, 2, 3]
        for d, j in ((a, ja), (b, jb)):
            spawned = [e for e in await events_of(d, j) if e.kind == "rank.spawned"]
            assert [e.data.get("pooled") for e in spawned] == [True, True]
        checksums = {r.checksum for r in va.ranks + vb.ranks}
        assert len(checksums) == 1 and None not in checksums
        for view in (va, vb):
            assert [n.node_rank for n in view.nodes] == [0, 1]
            assert {n.host for n in view.nodes} == {nodes[0].address, nodes[1].address}
            assert [n.state for n in view.nodes if n.local] == ["succeeded"]  # the other's, as last read
            assert sorted(r for n in view.nodes for r in n.ranks) == [0, 1, 2, 3]

        port = next(PORTS)
        script = ["tests/scripts/show_env.py"]
        theirs: dict[int, dict[str, str]] = {}

        async def under_torchrun() -> None:
            theirs.update(await torchrun_env(nodes, short_tmp, next(PORTS)))

        async with anyio.create_task_group() as tg:  # the same script under torchrun, meanwhile
            tg.start_soon(under_torchrun)
            ja = await a.client.submit(multinode(a, nodes, "same-run", port, script=script))
            jb = await b.client.submit(multinode(b, nodes, "same-run", port, script=script))
            va, vb = await wait_both(a, ja, b, jb)
        assert (va.state, vb.state) == ("SUCCEEDED", "SUCCEEDED"), (va.root_cause, vb.root_cause)
        ours = {**logged_env(va), **logged_env(vb)}
        assert sorted(ours) == sorted(theirs) == [0, 1, 2, 3]
        for rank in range(4):
            assert {k: ours[rank].get(k) for k in ENV_KEYS} == {k: theirs[rank].get(k) for k in ENV_KEYS}, rank
            assert ours[rank]["MASTER_ADDR"] in (nodes[0].address, nodes[1].address)
        missing = {k for k in theirs[0] if k.startswith(("TORCHELASTIC_", "GROUP_", "ROLE_", "LOCAL_", "MASTER_"))}
        # torchrun's agent-only settings (its file timer, the signals it forwards)
        assert missing - set(ours[0]) <= {"TORCHELASTIC_ENABLE_FILE_TIMER", "TORCHELASTIC_SIGNALS_TO_HANDLE"}


async def gone_within(pids: list[int], timeout: float) -> None:
    """Every pid has exited (another daemon's processes: orphaned, they may stay zombies until
    whoever adopted them reaps them)."""
    with anyio.fail_after(timeout):
        for pid in pids:
            await wait_gone(pid)
    for pid in pids:
        assert proc_state(pid) in ("Z", None), pid


def proc_state(pid: int) -> str | None:
    """The process's state letter in /proc (None: no such process)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


async def test_node_killed_survivor_resumes_then_late_node_joins(short_tmp: Path) -> None:
    """--nnodes 1:2, one restart: kill -9 of node b's daemon mid-training tears node a's ranks down
    within keep-alive + kill grace, names node b as lost, and node a re-forms alone and resumes from
    its checkpoint (a restart); a node that joins later is admitted at a re-form that costs no
    restart (a graceful stop), and both end with the same parameters. Nothing is left on either."""
    with two_nodes() as nodes:
        (short_tmp / "a").mkdir()
        (short_tmp / "b").mkdir()
        port = next(PORTS)
        spec: dict[str, Any] = {"nnodes": "1:2", "task": "tests.tasks:slow", "steps": 300, "checkpoint_every": 5,
                                "max_restarts": 1, "rdzv_last_call": 2.0, "options": {"step_sleep": 0.05},
                                "timeouts": {"kill_grace": GRACE}}
        async with running_daemon(short_tmp / "a", "--pool-size", "2", prefix=nodes[0].prefix) as a:
            async with anyio.create_task_group() as tg:
                b = await start_daemon(tg, short_tmp / "b", prefix=nodes[1].prefix)
                await pool_full(a)
                ja = await a.client.submit(multinode(a, nodes, "elastic", port, **spec))
                jb = await b.client.submit(multinode(b, nodes, "elastic", port, **spec))
                await a.wait_event(ja, lambda e: e.kind == "job.rendezvous" and e.data.get("nnodes") == 2)
                saved = await a.wait_event(ja, lambda e: e.kind == "job.checkpointed" and e.data["step"] >= 10)
                first_a, first_b = await a.client.status(ja), await b.client.status(jb)
                killed_at = time.time()
                b.proc.kill()
                await b.proc.wait()
                tg.cancel_scope.cancel()
            torn = await a.wait_event(ja, lambda e: e.kind == "job.torn_down" and e.attempt == saved.attempt)
            assert torn.ts - killed_at <= KEEP_ALIVE + GRACE + 2.0, torn.ts - killed_at
            await gone_within([r.pid for r in first_a.ranks if r.pid is not None], 10)
            assert_nothing_left([first_a])  # and reaped: no zombie either (node a's daemon is their parent)
            await gone_within([r.pid for r in first_b.ranks if r.pid is not None], 10)
            restarting = await a.wait_event(ja, lambda e: e.kind == "job.state_changed"
                                            and e.data.get("to") == "RESTARTING")
            assert f"node 1 (host {nodes[1].address}) lost" in restarting.data["root_cause"] or (
                f"(host {nodes[1].address})" in restarting.data["root_cause"]), restarting.data
            alone = await a.wait_event(ja, lambda e: e.kind == "job.rendezvous" and e.data.get("nnodes") == 1)

            # a late node: node b's daemon again, a new submit of the same run
            async with running_daemon(short_tmp / "b", prefix=nodes[1].prefix,
                                      state_dir=short_tmp / "b" / "state2") as b2:
                jb2 = await b2.client.submit(multinode(b2, nodes, "elastic", port, **spec))
                va, vb = await wait_both(a, ja, b2, jb2)
            assert (va.state, vb.state) == ("SUCCEEDED", "SUCCEEDED"), (va.root_cause, vb.root_cause)
            events = await events_of(a, ja)
            assert [e.data["nnodes"] for e in events if e.kind == "job.rendezvous"][-1] == 2
            resumed = [e.data["step"] for e in events if e.kind == "job.checkpointed" and e.attempt == alone.attempt]
            last_saved = max(e.data["step"] for e in events
                             if e.kind == "job.checkpointed" and e.attempt == saved.attempt)
            assert resumed and min(resumed) > last_saved, (last_saved, resumed)
            assert va.attempt == alone.attempt + 1  # the late node's re-form: one more attempt, no restart
            assert {r.checksum for r in va.ranks + vb.ranks} == {va.ranks[0].checksum}
            assert [r.step for r in va.ranks + vb.ranks] == [300] * 4


async def test_a_failed_node_and_a_cut_link_reach_the_other_node(short_tmp: Path) -> None:
    """A rank of node b is SIGKILLed: node b fails with it as the root cause and node a shows it,
    "node N (host b) failed: rank R died of signal SIGKILL". Then node b's link goes down
    mid-training: node a finds b's heartbeat frozen and node b finds the rendezvous store silent;
    each tears its ranks down within keep-alive + kill grace and says why."""
    async with two_daemons(short_tmp) as (nodes, a, b):
        spec: dict[str, Any] = {"task": "tests.tasks:slow", "steps": 100_000, "options": {"step_sleep": 0.05},
                                "timeouts": {"kill_grace": GRACE}}

        async def both_running(run: str) -> tuple[str, str]:
            port = next(PORTS)
            ja = await a.client.submit(multinode(a, nodes, run, port, **spec))
            jb = await b.client.submit(multinode(b, nodes, run, port, **spec))
            for d, j in ((a, ja), (b, jb)):
                await d.wait_event(j, lambda e: e.kind == "job.state_changed" and e.data.get("to") == "RUNNING")
            return ja, jb

        ja, jb = await both_running("rank-killed")
        victim = (await b.client.status(jb)).ranks[1]
        assert victim.pid is not None
        os.kill(victim.pid, signal.SIGKILL)
        va, vb = await wait_both(a, ja, b, jb, timeout=60)
        assert (va.state, vb.state) == ("FAILED", "FAILED")
        assert vb.root_cause is not None and vb.root_cause.rank == victim.rank, vb.root_cause
        node_b = next(n.node_rank for n in vb.nodes if n.local)
        expected = f"node {node_b} (host {nodes[1].address}) failed: rank {victim.rank} died of signal SIGKILL"
        assert va.root_cause is not None and (va.root_cause.detail or "").startswith(expected), va.root_cause
        assert (vb.root_cause.detail or "").startswith(expected), vb.root_cause

        ja, jb = await both_running("cut")
        cut_at = time.time()
        nodes[1].cut()
        va, vb = await wait_both(a, ja, b, jb, timeout=60)
        assert (va.state, vb.state) == ("FAILED", "FAILED")
        for d, j in ((a, ja), (b, jb)):
            torn = await d.wait_event(j, lambda e: e.kind == "job.torn_down")
            assert torn.ts - cut_at <= KEEP_ALIVE + GRACE + 2.0, (d.socket, torn.ts - cut_at)
        assert va.root_cause is not None and vb.root_cause is not None
        assert f"(host {nodes[1].address}) lost" in (va.root_cause.detail or ""), va.root_cause
        assert "unreachable" in (vb.root_cause.detail or ""), vb.root_cause
        assert "daemon of node" in (vb.root_cause.detail or ""), vb.root_cause
        assert [n.state for n in va.nodes if not n.local] == ["lost"]
        assert_nothing_left([va, vb])


async def test_a_rank_lost_on_one_node_is_replaced_there_and_both_nodes_train_on(short_tmp: Path) -> None:
    """--hot-replace across nodes: rank 3 (node b) is SIGKILLed mid-training; node b's daemon replaces it
    in place, node a's ranks (which their own daemon told nothing) read the replacement's generation
    from the job's store and re-form with it; both nodes end in their first attempt with the
    parameters of an uninterrupted run, node a's ranks and node b's survivor never restarted."""
    async with two_daemons(short_tmp, "--pool-size", "3") as (nodes, a, b):
        await pool_full(a)
        await pool_full(b)
        spec: dict[str, Any] = {"task": "tests.tasks:slow", "steps": 300, "seed": 3, "hot_replace": 1,
                                "options": {"step_sleep": 0.01}}
        port = next(PORTS)
        ra = await a.client.submit(multinode(a, nodes, "hot-reference", port, **spec))
        rb = await b.client.submit(multinode(b, nodes, "hot-reference", port, **spec))
        reference = await wait_both(a, ra, b, rb)
        assert [v.state for v in reference] == ["SUCCEEDED", "SUCCEEDED"], [v.root_cause for v in reference]
        expected = {r.checksum for v in reference for r in v.ranks}
        assert len(expected) == 1

        await pool_can_give(b, 3)  # the ranks, and a spare for the replacement
        port = next(PORTS)
        ja = await a.client.submit(multinode(a, nodes, "hot", port, **spec))
        jb = await b.client.submit(multinode(b, nodes, "hot", port, **spec))
        await b.wait_event(jb, lambda e: e.kind == "rank.progress" and e.data["step"] >= 60)
        before_a = {r.rank: r.pid for r in (await a.client.status(ja)).ranks}
        view_b = await b.client.status(jb)
        victim = next(r for r in view_b.ranks if r.rank == 3)
        assert victim.pid is not None
        os.kill(victim.pid, signal.SIGKILL)
        va, vb = await wait_both(a, ja, b, jb)
        said = [(e.kind, e.data) for e in await events_of(b, jb) if e.kind.startswith(("rank.lost", "rank.repl"))]
        assert (va.state, vb.state) == ("SUCCEEDED", "SUCCEEDED"), (va.root_cause, vb.root_cause, said)
        assert (va.attempt, vb.attempt) == (1, 1)
        got = {r.checksum for r in va.ranks + vb.ranks}  # all four ranks hold the same parameters, and
        assert len(got) == 1 and None not in got, got  # those of the uninterrupted run, to the last bits of a
        assert math.isclose(next(iter(got)) or 0.0, next(iter(expected)) or 0.0, rel_tol=1e-6), (got, expected)
        # float32 sum over four ranks (a re-formed DDP lays its buckets out anew; test_hot_replace.same_run)
        assert {r.rank: r.pid for r in va.ranks} == before_a
        assert [r.pid for r in vb.ranks if r.rank == 2] == [r.pid for r in view_b.ranks if r.rank == 2]
        kinds_b = [e.kind for e in await events_of(b, jb)]
        assert kinds_b.count("rank.replaced") == 1
        assert "rank.replaced" not in [e.kind for e in await events_of(a, ja)]
        assert_nothing_left([*reference, va, vb])
