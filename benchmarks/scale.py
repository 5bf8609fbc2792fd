"""The daemon at scale: hundreds of simulated workers heartbeating once a second.

A daemon of its own runs ``benchmarks/simworker.py`` in place of ``python -m ddpd.worker`` (the
``worker_command`` config knob): processes that speak the worker protocol without torch. The
benchmark submits `jobs` jobs of `ranks` ranks each (500 workers by default), waits until every
job is RUNNING, then measures over two windows of equal length:
  - the daemon's CPU use (utime + stime from /proc, in percent of one core) with nothing but
    the workers' heartbeats (and a Progress frame every 10 s per worker);
  - the same with a client asking for a job's status `status_rate` times a second (a new
    connection per request, as ddpctl does): the daemon's CPU use and each request's latency
    (p50, p99);
and the daemon's resident memory and the oldest heartbeat it holds at the end (a daemon that
falls behind shows old heartbeats). The jobs are then cancelled (each worker stops on the
daemon's Stop) and the daemon stopped.
"""

from __future__ import annotations

import math
import statistics
import time

import anyio

from ddpd.protocol import JobSpec

from .common import (
    DDPD,
    FINAL,
    PYTHON,
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


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


async def run_scale(ctx: Ctx, d: Daemon) -> None:
    plan = ctx.plan
    res = ctx.results
    n = plan.scale_jobs * plan.scale_ranks
    label = f"{n} simulated workers"
    spec = JobSpec(name="bench-sim", task="two-layer", nproc=plan.scale_ranks, steps=10**9)
    t0 = time.perf_counter()
    job_ids = [await d.client.submit(spec) for _ in range(plan.scale_jobs)]
    for job_id in job_ids:
        _, event = await d.events.wait(job_id, state_is("RUNNING", *FINAL), timeout=300)
        if event.data.get("to") != "RUNNING":
            view = await d.client.status(job_id)
            raise BenchError(f"simulated job {job_id} ended {view.state}: {why(view.root_cause)}")
    started = time.perf_counter() - t0
    res.metric("scale_start", "daemon at scale", f"{label}: submit → all RUNNING", "s").add(DDPD, started)
    ctx.say(f"  {n} simulated workers running after {started:.1f}s")
    await anyio.sleep(2.0)  # let the start-up burst of events drain

    a = CpuSample.take(d.pid)
    await anyio.sleep(plan.scale_window)
    b = CpuSample.take(d.pid)
    cpu_quiet = a.percent_until(b)
    res.metric("scale_cpu", "daemon at scale", f"{label}, heartbeats 1/s: CPU, % of one core", "%").add(
        DDPD, cpu_quiet)

    latencies: list[float] = []
    period = 1.0 / plan.status_rate
    a = CpuSample.take(d.pid)
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
    b = CpuSample.take(d.pid)
    cpu_busy = a.percent_until(b)
    res.metric("scale_cpu_status", "daemon at scale",
               f"{label} + status {plan.status_rate:.0f}/s: CPU, % of one core", "%").add(DDPD, cpu_busy)
    res.metric("scale_p50", "daemon at scale", f"status latency p50 ({len(latencies)} requests)", "ms").add(
        DDPD, 1000 * statistics.median(latencies))
    res.metric("scale_p99", "daemon at scale", f"status latency p99 ({len(latencies)} requests)", "ms").add(
        DDPD, 1000 * percentile(latencies, 0.99))
    res.metric("scale_rss", "daemon at scale", f"{label}: resident memory", "MiB").add(DDPD, rss_mib(d.pid))

    views = [await d.client.status(job_id) for job_id in job_ids]
    ages = [r.heartbeat_age for v in views for r in v.ranks if r.heartbeat_age is not None]
    training = sum(1 for v in views for r in v.ranks if r.state == "TRAINING")
    res.metric("scale_hb_age", "daemon at scale", "oldest heartbeat held at the end", "s").add(
        DDPD, max(ages) if ages else float("nan"))
    ctx.say(f"  CPU {cpu_quiet:.1f}% (heartbeats), {cpu_busy:.1f}% (+status); status p50 "
            f"{1000 * statistics.median(latencies):.1f}ms p99 {1000 * percentile(latencies, 0.99):.1f}ms; "
            f"{training}/{n} ranks TRAINING; oldest heartbeat {max(ages) if ages else float('nan'):.2f}s")
    if training != n:
        res.errors.append(f"scale: only {training} of {n} simulated ranks were TRAINING")

    for job_id in job_ids:
        await d.client.cancel(job_id)
    for job_id in job_ids:
        await d.events.wait(job_id, state_is(*FINAL), timeout=120)


async def bench_scale(ctx: Ctx) -> None:
    plan = ctx.plan
    n = plan.scale_jobs * plan.scale_ranks
    ctx.console.print(f"[bold]daemon at scale[/bold] ({plan.scale_jobs} jobs x {plan.scale_ranks} simulated "
                      f"workers, heartbeat 1/s, windows of {plan.scale_window:.0f}s)")
    d = await start_daemon(ctx.base, "ddpd-scale", config={"worker_command": [PYTHON, SIMWORKER],
                                                           "pool_size": 0},
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
