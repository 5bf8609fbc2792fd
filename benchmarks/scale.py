"""The daemon at scale: hundreds of simulated workers heartbeating once a second.

A daemon of its own runs ``benchmarks/simworker.sh`` in place of ``python -m ddpd.worker`` (the
``worker_command`` config knob): bash processes that speak the worker protocol without torch (and
start in a couple of milliseconds, so that what is measured is the daemon). The
benchmark submits jobs of `ranks` ranks each (500 workers by default) and measures how long it takes
from the first submit until every job is RUNNING, then, over two windows of equal length:
  - the daemon's CPU use (utime + stime from /proc, in percent of one core) with nothing but
    the workers' heartbeats (and a Progress frame every 10 s per worker);
  - the same with a client asking for a job's status `status_rate` times a second (a new
    connection per request, as ddpctl does): the daemon's CPU use and each request's latency
    (p50, p99);
and the daemon's resident memory and the oldest heartbeat it holds at the end (a daemon that
falls behind shows old heartbeats).

With more workers (``--workers 2000``) the daemon grows in steps (500, 1,000, 2,000: more jobs
submitted at each) and each step is measured the same way: the curve of CPU and status p99 shows
how the daemon's cost grows with its ranks. The targets are read at 500. The jobs are then
cancelled (each worker stops on the daemon's Stop) and the daemon stopped.
"""

from __future__ import annotations

import math
import shutil
import statistics
import time

import anyio

from ddpd.protocol import PROTOCOL_VERSION, JobSpec

from .common import (
    DDPD,
    FINAL,
    SIMWORKER,
    BenchError,
    CpuSample,
    Daemon,
    rss_mib,
    start_daemon,
    state_is,
    stop_daemon,
    why,
)
from .context import Ctx

BENCH = "daemon at scale"
BASH = shutil.which("bash") or "/bin/bash"
FIRST_STEP = 500  # the targets' point


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def steps(total: int) -> list[int]:
    """The sizes measured: 500, 1,000, 2,000 ... up to `total` (which is always one)."""
    out = [n for n in (FIRST_STEP, 2 * FIRST_STEP, 4 * FIRST_STEP) if n < total]
    return [*out, total]


def key(name: str, n: int, first: bool) -> str:
    """The metric of a step: the first step's keep the names the targets read."""
    return name if first else f"{name}_{n}"


async def start_jobs(ctx: Ctx, d: Daemon, count: int) -> tuple[list[str], float]:
    """Submit `count` jobs of the plan's ranks; their ids and the seconds until all are RUNNING."""
    spec = JobSpec(name="bench-sim", task="two-layer", nproc=ctx.plan.scale_ranks, steps=10**9)
    t0 = time.perf_counter()
    job_ids = [await d.client.submit(spec) for _ in range(count)]
    for job_id in job_ids:
        _, event = await d.events.wait(job_id, state_is("RUNNING", *FINAL), timeout=600)
        if event.data.get("to") != "RUNNING":
            view = await d.client.status(job_id)
            raise BenchError(f"simulated job {job_id} ended {view.state}: {why(view.root_cause)}")
    return job_ids, time.perf_counter() - t0


async def status_window(ctx: Ctx, d: Daemon, job_ids: list[str]) -> list[float]:
    """Status requests at the plan's rate for one window: their latencies."""
    plan = ctx.plan
    latencies: list[float] = []
    period = 1.0 / plan.status_rate
    end = time.perf_counter() + plan.scale_window
    next_at = time.perf_counter()
    i = 0
    while next_at < end:
        start = time.perf_counter()
        view = await d.client.status(job_ids[i % len(job_ids)])
        latencies.append(time.perf_counter() - start)
        if len(view.ranks) != plan.scale_ranks:
            raise BenchError(f"status of {view.id} shows {len(view.ranks)} ranks")
        i += 1
        next_at += period
        await anyio.sleep(max(0.0, next_at - time.perf_counter()))
    return latencies


async def measure(ctx: Ctx, d: Daemon, job_ids: list[str], n: int, first: bool) -> None:
    """The CPU windows, status latency, memory and heartbeats of `n` workers (jobs `job_ids`)."""
    plan, label = ctx.plan, f"{n} simulated workers"

    def put(name: str, title: str, unit: str, value: float) -> None:
        ctx.results.metric(key(name, n, first), BENCH, f"{label}{title}", unit).add(DDPD, value)

    await anyio.sleep(2.0)  # let the start-up burst of events drain
    a = CpuSample.take(d.pid)
    await anyio.sleep(plan.scale_window)
    cpu_quiet = a.percent_until(CpuSample.take(d.pid))
    put("scale_cpu", ", heartbeats 1/s: CPU, % of one core", "%", cpu_quiet)
    a = CpuSample.take(d.pid)
    latencies = await status_window(ctx, d, job_ids)
    cpu_busy = a.percent_until(CpuSample.take(d.pid))
    put("scale_cpu_status", f" + status {plan.status_rate:.0f}/s: CPU, % of one core", "%", cpu_busy)
    p50, p99 = 1000 * statistics.median(latencies), 1000 * percentile(latencies, 0.99)
    put("scale_p50", f": status latency p50 ({len(latencies)} requests)", "ms", p50)
    put("scale_p99", f": status latency p99 ({len(latencies)} requests)", "ms", p99)
    put("scale_rss", ": resident memory", "MiB", rss_mib(d.pid))
    views = [await d.client.status(job_id) for job_id in job_ids]
    ages = [r.heartbeat_age for v in views for r in v.ranks if r.heartbeat_age is not None]
    training = sum(1 for v in views for r in v.ranks if r.state == "TRAINING")
    oldest = max(ages) if ages else float("nan")
    put("scale_hb_age", ": oldest heartbeat held at the end", "s", oldest)
    ctx.say(f"  {n} workers: CPU {cpu_quiet:.1f}% (heartbeats), {cpu_busy:.1f}% (+status); status p50 {p50:.1f}ms "
            f"p99 {p99:.1f}ms; {training}/{n} ranks TRAINING; oldest heartbeat {oldest:.2f}s")
    if training != n:
        ctx.results.errors.append(f"scale: only {training} of {n} simulated ranks were TRAINING")


async def run_scale(ctx: Ctx, d: Daemon) -> None:
    plan = ctx.plan
    job_ids: list[str] = []
    try:
        for i, n in enumerate(steps(plan.scale_jobs * plan.scale_ranks)):
            more, started = await start_jobs(ctx, d, n // plan.scale_ranks - len(job_ids))
            job_ids += more
            if i == 0:
                ctx.results.metric("scale_start", BENCH, f"{n} simulated workers: submit → all RUNNING", "s").add(
                    DDPD, started)
            ctx.say(f"  {n} simulated workers running ({len(more) * plan.scale_ranks} started in {started:.1f}s)")
            await measure(ctx, d, job_ids, n, first=i == 0)
    finally:
        with anyio.CancelScope(shield=True):
            for job_id in job_ids:
                await d.client.cancel(job_id)
            for job_id in job_ids:
                await d.events.wait(job_id, state_is(*FINAL), timeout=300)


async def bench_scale(ctx: Ctx) -> None:
    plan = ctx.plan
    n = plan.scale_jobs * plan.scale_ranks
    ctx.console.print(f"[bold]daemon at scale[/bold] ({plan.scale_jobs} jobs x {plan.scale_ranks} simulated "
                      f"workers, heartbeat 1/s, windows of {plan.scale_window:.0f}s, measured at "
                      f"{', '.join(str(s) for s in steps(n))})")
    worker = [BASH, SIMWORKER, "--protocol", str(PROTOCOL_VERSION)]
    d = await start_daemon(ctx.base, "ddpd-scale", config={"worker_command": worker, "pool_size": 0},
                           flags=["--cpu-slots", str(max(n, 1))])
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(d.follow_events)
            try:
                await run_scale(ctx, d)
            finally:
                tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            rc = await stop_daemon(d)
            if rc != 0:
                ctx.results.errors.append(f"scale daemon exited with {rc}:\n{d.log_tail(10)}")
