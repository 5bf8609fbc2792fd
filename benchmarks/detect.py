"""Detection: one rank SIGKILLed mid-training, until the job is failed and no process of it is left.

The job is the `mlp` model (width 512, so a step takes milliseconds, as real steps do) with an
endless step count. Rank 1 is killed once both ranks have taken a few steps (ddpd: their
``rank.progress`` events; torchrun/mp.spawn: the rank files say they are past the warm-up).

  - ddpd: from the SIGKILL until the FAILED event has arrived here *and* every rank pid and
    the job's process group are gone (``os.killpg(pgid, 0)`` raises ProcessLookupError).
  - torchrun / mp.spawn: from the SIGKILL until the launcher has exited *and* no rank remains.

A second metric is the first half alone: until the job is marked failed (ddpd) or the launcher
has exited (torchrun, mp.spawn).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Awaitable, Callable
from functools import partial

import anyio

from ddpd.protocol import JobSpec
from ddpd.protocol.control import EventView

from .common import (
    DDPD,
    FINAL,
    SPAWN,
    TORCHRUN_NAME,
    BenchError,
    Daemon,
    state_is,
    wait_gone,
    wait_group_gone,
)
from .context import Ctx
from .launchers import start_launcher

ENDLESS = 10**7
WARM_STEPS = 3


def progressed(rank: int, steps: int) -> Callable[[EventView], bool]:
    return lambda e: e.kind == "rank.progress" and e.rank == rank and int(e.data.get("step", 0)) >= steps


async def detect_ddpd(ctx: Ctx, d: Daemon) -> tuple[float, float]:
    # no hot replacement (a task's default): the failure itself is measured, as under torchrun
    spec = JobSpec(name="bench-detect", task="mlp", nproc=2, steps=ENDLESS, hot_replace=0,
                   options={"width": ctx.plan.detect_width})
    job_id = await d.client.submit(spec)
    try:
        for r in (0, 1):
            await d.events.wait(job_id, progressed(r, WARM_STEPS), timeout=120)
        view = await d.client.status(job_id)
        pids = [r.pid for r in view.ranks if r.pid is not None]
        pgid = view.ranks[0].pgid
        if len(pids) != 2 or pgid is None:
            raise BenchError(f"status of {job_id} lacks pids: {view.ranks}")
        failed_at = gone_at = 0.0
        t_kill = time.perf_counter()
        os.kill(pids[1], signal.SIGKILL)

        async def failed() -> None:
            nonlocal failed_at
            failed_at, event = await d.events.wait(job_id, state_is(*FINAL), timeout=60)
            if event.data.get("to") != "FAILED":
                raise BenchError(f"job {job_id} ended {event.data.get('to')}, not FAILED")

        async def gone() -> None:
            nonlocal gone_at
            await wait_gone(pids)
            await wait_group_gone(pgid)
            gone_at = time.perf_counter()

        async with anyio.create_task_group() as tg:
            tg.start_soon(failed)
            tg.start_soon(gone)
        return max(failed_at, gone_at) - t_kill, failed_at - t_kill
    finally:
        view = await d.client.status(job_id)
        if view.state not in FINAL:
            await d.client.cancel(job_id, force=True)


async def detect_launcher(ctx: Ctx, kind: str) -> tuple[float, float]:
    run = await start_launcher(kind, ctx.base, ["--task", "mlp", "--width", str(ctx.plan.detect_width),
                                                "--steps", str(ENDLESS), "--warmup", str(WARM_STEPS)])
    try:
        stamps = await run.wait_stamps(2, "warm", timeout=120)
        pids = [int(stamps[r]["pid"]) for r in (0, 1)]
        t_kill = time.perf_counter()
        os.kill(pids[1], signal.SIGKILL)
        with anyio.fail_after(60):
            await run.proc.wait()
        exited_at = time.perf_counter()
        await wait_gone(pids)
        gone_at = time.perf_counter()
        return max(exited_at, gone_at) - t_kill, exited_at - t_kill
    finally:
        run.kill()


async def bench_detect(ctx: Ctx) -> None:
    ctx.console.print(f"[bold]detection[/bold] (rank 1 SIGKILLed mid-training; mlp width {ctx.plan.detect_width})")
    total = ctx.results.metric("detect", "detection", "SIGKILL → job failed and every process gone", "s")
    first = ctx.results.metric("detect_failed", "detection", "SIGKILL → marked failed / launcher exited", "s")
    runners: list[tuple[str, Callable[[], Awaitable[tuple[float, float]]]]] = []
    if DDPD in ctx.daemons:
        runners.append((DDPD, partial(detect_ddpd, ctx, ctx.daemons[DDPD])))
    for kind in (TORCHRUN_NAME, SPAWN):
        runners.append((kind, partial(detect_launcher, ctx, kind)))

    def record(name: str, value: tuple[float, float]) -> str:
        total.add(name, value[0])
        first.add(name, value[1])
        return f"all gone {value[0]:.3f}s  failed/exited {value[1]:.3f}s"

    await ctx.alternate(ctx.plan.detect_reps, runners, record, [total, first])
