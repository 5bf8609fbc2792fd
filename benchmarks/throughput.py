"""Throughput: steady-state steps per second of the `mlp` model, and the daemon's cost meanwhile.

The model: 4 x (Linear(1024, 1024) + ReLU), batch 64, MSE, SGD, 2 ranks, gloo on CPU. ddpd runs
its built-in ``mlp`` task; torchrun and mp.spawn run ``ddp_script.py --task mlp`` (the same
model, data shapes and optimizer). The first `warmup` steps (the DDP constructor, first
allocations) are left out:
  - ddpd: rank 0's ``rank.progress`` events (the daemon stamps each with its arrival time):
    (last step - first step at or after warm-up) / (time between those two events);
  - torchrun / mp.spawn: rank 0 writes the time at step `warmup` and at its last step.

While ddpd trains, the daemon's CPU time (utime + stime from /proc) is sampled at the first
steady-state event and again when the first rank's result arrives: its CPU use, in percent of
one core, and its resident memory. The daemon's idle cost is measured once, before any job.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial

import anyio

from ddpd.protocol import JobSpec
from ddpd.protocol.control import EventView

from .common import (
    DDPD,
    DDPD_COLD,
    FINAL,
    SPAWN,
    TORCHRUN_NAME,
    BenchError,
    CpuSample,
    Daemon,
    rss_mib,
    state_is,
    why,
)
from .context import Ctx
from .launchers import start_launcher

LAYERS, WIDTH, BATCH = 4, 1024, 64


async def throughput_ddpd(ctx: Ctx, d: Daemon) -> tuple[float, float, float]:
    warmup = ctx.plan.throughput_warmup
    spec = JobSpec(name="bench-mlp", task="mlp", nproc=2, steps=ctx.plan.throughput_steps,
                   options={"layers": LAYERS, "width": WIDTH, "batch": BATCH})
    job_id = await d.client.submit(spec)

    def steady(e: EventView) -> bool:
        return e.kind == "rank.progress" and e.rank == 0 and int(e.data.get("step", 0)) >= warmup

    await d.events.wait(job_id, steady, timeout=300)
    a = CpuSample.take(d.pid)
    await d.events.wait(job_id, lambda e: e.kind in ("rank.result", "rank.exited") or
                        (e.kind == "job.state_changed" and e.data.get("to") in FINAL), timeout=600)
    b = CpuSample.take(d.pid)
    rss = rss_mib(d.pid)
    _, done = await d.events.wait(job_id, state_is(*FINAL), timeout=120)
    if done.data.get("to") != "SUCCEEDED":
        view = await d.client.status(job_id)
        raise BenchError(f"mlp job {job_id} ended {view.state}: {why(view.root_cause)}")
    progress = [e for _, e in d.events.by_job[job_id] if steady(e)]
    if len(progress) < 2 or progress[-1].ts <= progress[0].ts:
        raise BenchError(f"too few progress events after warm-up ({len(progress)}); raise the step count")
    first, last = progress[0], progress[-1]
    rate = (int(last.data["step"]) - int(first.data["step"])) / (last.ts - first.ts)
    return rate, a.percent_until(b), rss


async def throughput_launcher(ctx: Ctx, kind: str) -> tuple[float, float, float]:
    run = await start_launcher(kind, ctx.base, ["--task", "mlp", "--steps", str(ctx.plan.throughput_steps),
                                                "--warmup", str(ctx.plan.throughput_warmup), "--layers", str(LAYERS),
                                                "--width", str(WIDTH), "--batch", str(BATCH)])
    try:
        with anyio.fail_after(900):
            rc = await run.proc.wait()
        if rc != 0:
            raise BenchError(f"{kind} exited with {rc}:\n{run.log_tail()}")
        s = run.read_stamps()[0]
        rate = (int(s["steps"]) - int(s["warm_step"])) / (float(s["end"]) - float(s["warm"]))
    finally:
        run.kill()
    return rate, float("nan"), float("nan")


async def daemon_idle(ctx: Ctx, d: Daemon) -> None:
    await ctx.settle()
    a = CpuSample.take(d.pid)
    await anyio.sleep(ctx.plan.idle_window)
    b = CpuSample.take(d.pid)
    ctx.results.metric("cost_idle_cpu", "daemon cost", "idle: CPU, % of one core", "%").add(d.name, a.percent_until(b))
    ctx.results.metric("cost_idle_rss", "daemon cost", "idle: resident memory", "MiB").add(d.name, rss_mib(d.pid))


async def bench_throughput(ctx: Ctx) -> None:
    plan = ctx.plan
    ctx.console.print(f"[bold]throughput[/bold] (mlp {LAYERS} x Linear({WIDTH},{WIDTH}), batch {BATCH}, "
                      f"{plan.throughput_steps} steps, first {plan.throughput_warmup} not counted, 2 ranks)")
    rate = ctx.results.metric("throughput", "throughput", "steady-state steps/s (mlp)", "steps/s",
                              higher_is_better=True)
    cpu = ctx.results.metric("cost_train_cpu", "daemon cost", "supervising mlp (2 ranks): CPU, % of one core", "%")
    rss = ctx.results.metric("cost_train_rss", "daemon cost", "supervising mlp (2 ranks): resident memory", "MiB")
    runners: list[tuple[str, Callable[[], Awaitable[tuple[float, float, float]]]]] = []
    for name in (DDPD, DDPD_COLD):
        if name in ctx.daemons:
            runners.append((name, partial(throughput_ddpd, ctx, ctx.daemons[name])))
    for kind in (TORCHRUN_NAME, SPAWN):
        runners.append((kind, partial(throughput_launcher, ctx, kind)))

    def record(name: str, value: tuple[float, float, float]) -> str:
        rate.add(name, value[0])
        if name.startswith(DDPD):
            cpu.add(name, value[1])
            rss.add(name, value[2])
            return f"{value[0]:.2f} steps/s  daemon {value[1]:.1f}% CPU, {value[2]:.0f} MiB"
        return f"{value[0]:.2f} steps/s"

    await ctx.alternate(plan.throughput_reps, runners, record, [rate])
