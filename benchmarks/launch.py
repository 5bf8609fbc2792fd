"""Launch and end to end: the classic two-rank two-layer job (20 steps) under each launcher.

One run gives both numbers:
  - launch: from just before submit (ddpd) or the launcher's start (torchrun, mp.spawn) until
    every rank's ``init_process_group`` has returned. ddpd: the arrival here of the
    ``job.state_changed`` event to RUNNING, which the daemon emits when the last rank reports
    ``joined`` (sent right after ``init_process_group`` returns). torchrun/mp.spawn: each rank
    writes ``time.time()`` after ``init_process_group``; launch = the latest of them minus the
    wall time at the launcher's start.
  - end to end: until the job is SUCCEEDED (the event's arrival; the daemon reaps every rank
    first) or the launcher process has exited with 0.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from functools import partial

from ddpd.protocol import JobSpec

from .common import DDPD, DDPD_COLD, FINAL, SPAWN, TORCHRUN_NAME, BenchError, Daemon, state_is, why
from .context import Ctx
from .launchers import start_launcher

CLASSIC_STEPS = 20


async def classic_ddpd(d: Daemon) -> tuple[float, float]:
    spec = JobSpec(name="bench-classic", task="two-layer", nproc=2, steps=CLASSIC_STEPS)
    t0 = time.perf_counter()
    job_id = await d.client.submit(spec)
    t_running, running = await d.events.wait(job_id, state_is("RUNNING", *FINAL))
    t_done, done = await d.events.wait(job_id, state_is(*FINAL))
    if running.data.get("to") != "RUNNING" or done.data.get("to") != "SUCCEEDED":
        view = await d.client.status(job_id)
        raise BenchError(f"{d.name}: job {job_id} ended {view.state}: {why(view.root_cause)}")
    return t_running - t0, t_done - t0


async def classic_launcher(ctx: Ctx, kind: str) -> tuple[float, float]:
    run = await start_launcher(kind, ctx.base, ["--task", "two-layer", "--steps", str(CLASSIC_STEPS)])
    try:
        rc = await run.proc.wait()
        t_done = time.perf_counter()
        if rc != 0:
            raise BenchError(f"{kind} exited with {rc}:\n{run.log_tail()}")
        stamps = run.read_stamps()
        if len(stamps) != 2:
            raise BenchError(f"{kind}: {len(stamps)} of 2 ranks wrote their stamps")
        launch = max(float(s["init"]) for s in stamps.values()) - run.t0_wall
    finally:
        run.kill()
    return launch, t_done - run.t0


async def bench_launch(ctx: Ctx) -> None:
    ctx.console.print("[bold]launch and end to end[/bold] (classic two-layer job, 2 ranks, 20 steps)")
    launch = ctx.results.metric("launch", "launch", "submit → every rank's init_process_group returned", "s")
    e2e = ctx.results.metric("e2e", "end to end", "classic job: submit → done", "s")
    runners: list[tuple[str, Callable[[], Awaitable[tuple[float, float]]]]] = []
    for name in (DDPD, DDPD_COLD):
        if name in ctx.daemons:
            runners.append((name, partial(classic_ddpd, ctx.daemons[name])))
    for kind in (TORCHRUN_NAME, SPAWN):
        runners.append((kind, partial(classic_launcher, ctx, kind)))

    def record(name: str, value: tuple[float, float]) -> str:
        launch.add(name, value[0])
        e2e.add(name, value[1])
        return f"launch {value[0]:.3f}s  end to end {value[1]:.3f}s"

    await ctx.alternate(ctx.plan.launch_reps, runners, record, [launch, e2e])
