"""Multi-node launch: two nodes (network namespaces on this machine, joined by a veth pair) x 2 ranks.

Measured from the submit on both nodes (ddpd: one daemon per node, both submits sent at once) or
the start of both torchrun processes (``--nnodes 2 --rdzv-backend c10d``, the same endpoint on
node a) until all four ranks' ``init_process_group`` has returned. ddpd: the later of the two
daemons' ``job.state_changed`` to RUNNING (each emits it once its own ranks have joined, and a
join returns only when the whole world has). torchrun: the latest ``init`` stamp of the four
ranks minus the wall time at the start. Alternating, in the same run. Needs root and
``ip netns``; skipped with the reason otherwise.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import anyio

from ddpd.protocol import JobSpec

from .common import (
    DDP_SCRIPT,
    DDPD,
    FINAL,
    TORCHRUN,
    TORCHRUN_NAME,
    BenchError,
    Daemon,
    start_daemon,
    state_is,
    stop_daemon,
    why,
)
from .context import Ctx
from .launchers import LauncherRun, open_log

ADDRESSES = ("10.78.0.1", "10.78.0.2")
LINK = "mn0"
ENV = {"GLOO_SOCKET_IFNAME": LINK}


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@contextlib.contextmanager
def two_namespaces() -> Iterator[tuple[str, str]]:
    tag = str(os.getpid())
    names = (f"ddpd-bench-a-{tag}", f"ddpd-bench-b-{tag}")
    ends = (f"bna{tag}"[:15], f"bnb{tag}"[:15])
    try:
        for ns in names:
            _ip("netns", "add", ns)
        _ip("link", "add", ends[0], "type", "veth", "peer", "name", ends[1])
        for ns, end, address in zip(names, ends, ADDRESSES, strict=True):
            _ip("link", "set", end, "netns", ns)
            _ip("-n", ns, "link", "set", end, "name", LINK)
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", LINK)
            _ip("-n", ns, "link", "set", LINK, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield names
    finally:
        for ns in names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def prefix(ns: str) -> list[str]:
    return ["ip", "netns", "exec", ns]


async def ddpd_two_nodes(daemons: tuple[Daemon, Daemon], port: int, run: str) -> float:
    spec = JobSpec(name="bench-multinode", task="two-layer", nproc=2, steps=20, nnodes="2", env=ENV,
                   rdzv_endpoint=f"{ADDRESSES[0]}:{port}", rdzv_id=run)
    t0 = time.perf_counter()
    ids: list[str] = ["", ""]

    async def submit(i: int) -> None:
        ids[i] = await daemons[i].client.submit(spec)

    async with anyio.create_task_group() as tg:
        for i in range(2):
            tg.start_soon(submit, i)
    running = [await d.events.wait(j, state_is("RUNNING", *FINAL)) for d, j in zip(daemons, ids, strict=True)]
    for d, j in zip(daemons, ids, strict=True):
        _, done = await d.events.wait(j, state_is(*FINAL))
        if done.data.get("to") != "SUCCEEDED":
            view = await d.client.status(j)
            raise BenchError(f"{d.name}: job {j} ended {view.state}: {why(view.root_cause)}")
    return max(at for at, _ in running) - t0


async def torchrun_two_nodes(ctx: Ctx, names: tuple[str, str], port: int) -> float:
    run_dir = Path(tempfile.mkdtemp(prefix="torchrun-2n-", dir=ctx.base))
    stamps = run_dir / "stamps"
    runs = []
    t0_wall, t0 = time.time(), time.perf_counter()
    for i, ns in enumerate(names):
        argv = [*prefix(ns), TORCHRUN, "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{ADDRESSES[0]}:{port}", "--rdzv-id", f"bench-{port}",
                "--local-addr", ADDRESSES[i], "--rdzv-conf", f"is_host={int(i == 0)}",
                DDP_SCRIPT, "--stamps", str(stamps), "--task", "two-layer", "--steps", "20"]
        log = open_log(run_dir / f"node-{i}.log")
        try:
            proc = await anyio.open_process(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                            env={**os.environ, **ENV}, cwd=str(run_dir), start_new_session=True)
        finally:
            log.close()
        runs.append(LauncherRun(TORCHRUN_NAME, proc, stamps, run_dir / f"node-{i}.log", t0, t0_wall))
    try:
        with anyio.fail_after(300):
            codes = [await r.proc.wait() for r in runs]
        if codes != [0, 0]:
            raise BenchError(f"torchrun exited with {codes}:\n{runs[0].log_tail()}\n{runs[1].log_tail()}")
        found = runs[0].read_stamps()
        if len(found) != 4:
            raise BenchError(f"torchrun: {len(found)} of 4 ranks wrote their stamps")
        return max(float(s["init"]) for s in found.values()) - t0_wall
    finally:
        for r in runs:
            r.kill()


async def bench_multinode(ctx: Ctx) -> None:
    ctx.console.print("[bold]multi-node launch[/bold] (2 nodes in network namespaces x 2 ranks, two-layer)")
    if os.geteuid() != 0:
        ctx.say("  skipped: network namespaces need root")
        return
    metric = ctx.results.metric("multinode_launch", "multi-node", "submit on both nodes → all 4 ranks joined", "s")
    ports = iter(range(29600, 29700))
    with two_namespaces() as names:
        daemons: list[Daemon] = []
        async with anyio.create_task_group() as tg:
            try:
                for i, ns in enumerate(names):
                    d = await start_daemon(ctx.base, f"ddpd-node-{i}", flags=["--gpus", "0"], prefix=prefix(ns))
                    daemons.append(d)
                    await tg.start(d.follow_events)
                pair = (daemons[0], daemons[1])
                # unmeasured, on both sides alike: the daemons' first job, torchrun's first run
                await ddpd_two_nodes(pair, next(ports), "warmup")
                await torchrun_two_nodes(ctx, names, next(ports))
                rep = 0

                async def ours() -> float:
                    nonlocal rep
                    rep += 1
                    return await ddpd_two_nodes(pair, next(ports), f"bench-{rep}")

                async def theirs() -> float:
                    return await torchrun_two_nodes(ctx, names, next(ports))

                def record(name: str, value: float) -> str:
                    metric.add(name, value)
                    return f"{value:.2f} s"

                await ctx.alternate(ctx.plan.launch_reps, [(DDPD, ours), (TORCHRUN_NAME, theirs)], record, [metric])
            finally:
                tg.cancel_scope.cancel()
                with anyio.CancelScope(shield=True):
                    for d in daemons:
                        rc = await stop_daemon(d)
                        if rc != 0:
                            ctx.results.errors.append(f"daemon {d.name} exited with {rc}:\n{d.log_tail(10)}")
    ctx.say(f"  ratio ddpd / torchrun: {metric.ratio(DDPD, TORCHRUN_NAME):.2f}")
