"""``python -m benchmarks [--short] [--json PATH] [--only NAMES]``: ddpd vs torchrun vs mp.spawn.

Runs, in one process and on the same work, alternating the launchers in every repetition:
launch and end to end (the classic job), detection (a rank SIGKILLed), throughput (the mlp
model) with the daemon's cost while supervising, the daemon at scale (simulated workers), and its
start-up and memory with a long history of ended jobs, and ping latency while hostile jobs and
clients run (``hostile``), and a two-node job against two torchruns (``multinode``, root only).
Prints medians, min-max ranges and ratios, then the issue's targets, met or missed.

Two daemons serve the ddpd runs: ``ddpd`` with a warm pool (``pool_size``, default 2) and
``ddpd (cold)`` without; each is started once and stopped at the end. Whatever the run started
is killed and reaped at the end, on error and on Ctrl-C too.
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import sys
import time
import traceback
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from types import FrameType

import anyio
import torch
from rich.console import Console

from ddpd.protocol import JobSpec

from .common import (
    DDPD,
    DDPD_COLD,
    FINAL,
    SPAWN,
    TORCHRUN_NAME,
    Daemon,
    cleanup_dir,
    install_token,
    scratch_dir,
    start_daemon,
    state_is,
    stop_daemon,
    sweep,
    why,
)
from .context import Ctx, Plan
from .detect import bench_detect
from .history import bench_history
from .hostile import bench_hostile
from .hot_replace import bench_hot_replace
from .launch import bench_launch, classic_launcher
from .loop import bench_loop
from .multinode import bench_multinode
from .optimizer_hook import bench_optimizer_hook
from .paired import bench_paired
from .pool_forkserver import bench_forkserver
from .report import dump_json, print_report
from .results import Results
from .scale import bench_scale
from .throughput import bench_throughput, daemon_idle

BENCHES: dict[str, Callable[[Ctx], Awaitable[None]]] = {
    "launch": bench_launch,
    "detect": bench_detect,
    "throughput": bench_throughput,
    "scale": bench_scale,
    "loop": bench_loop,
    "paired": bench_paired,
    "history": bench_history,
    "optimizer_hook": bench_optimizer_hook,
    "hostile": bench_hostile,
    "multinode": bench_multinode,
    "hot_replace": bench_hot_replace,
    "forkserver": bench_forkserver,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0] if __doc__ else "")
    p.add_argument("--short", action="store_true", help="fewer repetitions and shorter windows (a few minutes)")
    p.add_argument("--json", type=Path, help="also write every measurement to this file")
    p.add_argument("--only", help=f"comma-separated subset of {','.join(BENCHES)}")
    p.add_argument("--reps", type=int, help="repetitions per launcher (overrides the default of each benchmark)")
    p.add_argument("--pool-size", type=int, default=2, help="warm pool of the `ddpd` daemon (default 2)")
    p.add_argument("--workers", type=int, default=500, help="simulated workers of the scale benchmark")
    args = p.parse_args(argv)
    names = args.only.split(",") if args.only else list(BENCHES)
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        p.error(f"unknown benchmark(s) {unknown}; choose from {list(BENCHES)}")
    args.names = names
    return args


async def warm_up(ctx: Ctx, d: Daemon) -> None:
    """One unmeasured classic job per daemon: page cache, the daemon's first job, the pool's first fill
    (`warm_up_launchers` gives torchrun and mp.spawn their unmeasured first run too)."""
    job_id = await d.client.submit(JobSpec(name="bench-warmup", task="two-layer", nproc=2, steps=20))
    _, event = await d.events.wait(job_id, state_is(*FINAL), timeout=300)
    if event.data.get("to") != "SUCCEEDED":
        view = await d.client.status(job_id)
        raise RuntimeError(f"{d.name}: the warm-up job ended {view.state}: {why(view.root_cause)}\n{d.log_tail()}")


async def warm_up_launchers(ctx: Ctx) -> None:
    """One unmeasured classic run per launcher, as each daemon has its warm-up job: every side's
    first run (cold page cache, first imports) is dropped alike."""
    for kind in (TORCHRUN_NAME, SPAWN):
        await classic_launcher(ctx, kind)


async def run(ctx: Ctx, names: list[str]) -> None:
    needs_daemons = any(n in names for n in ("launch", "detect", "throughput"))
    if needs_daemons:
        async with anyio.create_task_group() as tg:
            try:
                ctx.say("starting the daemons (warm pool and cold) and one warm-up job each")
                ctx.daemons[DDPD] = await start_daemon(ctx.base, DDPD, config={"pool_size": ctx.plan.pool_size})
                if "launch" in names or "throughput" in names:
                    ctx.daemons[DDPD_COLD] = await start_daemon(ctx.base, DDPD_COLD, config={"pool_size": 0})
                for d in ctx.daemons.values():
                    await tg.start(d.follow_events)
                for d in ctx.daemons.values():
                    await warm_up(ctx, d)
                await warm_up_launchers(ctx)
                for d in ctx.daemons.values():
                    await daemon_idle(ctx, d)
                for name in ("launch", "detect", "throughput"):
                    if name in names:
                        await run_bench(ctx, name)
            finally:
                tg.cancel_scope.cancel()
                with anyio.CancelScope(shield=True):
                    for d in ctx.daemons.values():
                        rc = await stop_daemon(d)
                        if rc != 0:
                            ctx.results.errors.append(f"daemon {d.name} exited with {rc}:\n{d.log_tail(10)}")
                    ctx.daemons.clear()
    if "scale" in names:
        await run_bench(ctx, "scale")
    if "history" in names:
        await run_bench(ctx, "history")
    if "hostile" in names:
        await run_bench(ctx, "hostile")
    if "loop" in names:
        await run_bench(ctx, "loop")
    if "paired" in names:
        await run_bench(ctx, "paired")
    if "multinode" in names:
        await run_bench(ctx, "multinode")
    if "hot_replace" in names:
        await run_bench(ctx, "hot_replace")
    if "forkserver" in names:
        await run_bench(ctx, "forkserver")


async def run_bench(ctx: Ctx, name: str) -> None:
    start = time.perf_counter()
    try:
        await BENCHES[name](ctx)
    except Exception as exc:
        leaves = list(leaf_exceptions(exc))
        ctx.results.errors.append(f"{name}: " + "; ".join(f"{type(e).__name__}: {e}" for e in leaves))
        for leaf in leaves:
            ctx.console.print(f"[red]{name} failed:[/red]", markup=True)
            ctx.console.print("".join(traceback.format_exception(leaf)), markup=False, style="red")
    ctx.say(f"  ({name}: {time.perf_counter() - start:.0f}s)")


def leaf_exceptions(exc: BaseException) -> Iterator[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from leaf_exceptions(inner)
    else:
        yield exc


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = Plan.make(args.short, args.reps, args.pool_size, args.workers)
    console = Console(highlight=False)
    if not console.is_terminal:
        console = Console(highlight=False, width=150)
    token = install_token()
    base = scratch_dir()
    results = Results()
    results.info = {"python": platform.python_version(), "torch": str(torch.__version__), "cpus": os.cpu_count(),
                    "affinity": len(os.sched_getaffinity(0)), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    ctx = Ctx(plan=plan, token=token, base=base, results=results, console=console)
    console.print(f"ddpd benchmarks ({'short' if plan.short else 'full'}): {', '.join(args.names)}; "
                  f"{results.info['affinity']} CPUs, torch {results.info['torch']}, pool size {plan.pool_size}")
    signal.signal(signal.SIGTERM, _terminate)
    started = time.perf_counter()
    interrupted = False
    try:
        anyio.run(run, ctx, args.names)
    except KeyboardInterrupt:
        interrupted = True
        console.print("[red]interrupted[/red]")
    finally:
        left = sweep(token)
        cleanup_dir(base)
        if left:
            results.errors.append(f"{len(left)} process(es) of this run were still alive at the end and were "
                                  f"killed: {left}")
    results.info["seconds"] = round(time.perf_counter() - started, 1)
    items = print_report(console, results)
    console.print(f"[dim]{results.info['seconds']:.0f}s in all; no process of this run is left[/dim]")
    if args.json:
        dump_json(args.json, plan, results, items)
        console.print(f"[dim]results written to {args.json}[/dim]")
    failed = any(metric.failures for metric in results.metrics.values())
    return 130 if interrupted else (1 if results.errors or failed else 0)


if __name__ == "__main__":
    sys.exit(main())
