"""Hot rank replacement: rank 1 SIGKILLed mid-training; how long until every rank trains again, and
how many steps were lost, for three ways of surviving it (alternating, one job each per repetition):

  - ``ddpd (hot)``: the mlp task with its default hot replacement, on a daemon with the default warm
    pool (4: a 2-rank job leaves two spare interpreters). From the SIGKILL until every rank has
    reported a step after the one the group resumed at (``rank.replaced``, then ``rank.progress``).
  - ``ddpd (restart)``: the same job with ``hot_replace=0``, ``max_restarts=1`` and a checkpoint every
    CHECKPOINT_EVERY steps: the attempt fails, the next one resumes from the checkpoint. Until every
    rank of attempt 2 has reported its first step.
  - ``torchrun``: ``--max-restarts 1`` and benchmarks/ddp_script.py with the same checkpoint every
    CHECKPOINT_EVERY steps: torchrun restarts every worker; until every rank has stamped its first
    step after the restart.

Steps lost: the step rank 0 had reached when rank 1 was killed (as far as it had said: heartbeats
and progress for ddpd, its per-step stamp for torchrun) minus the step training resumed from. It is
a lower bound for the restarts (rank 0 may have gone further than it said) and exact for the hot
path, whose group resumes at the step rank 0 completed (0 lost; the redone step in flight is not
a lost one).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path

import anyio

from ddpd.protocol import JobSpec
from ddpd.protocol.control import EventView

from .common import TORCHRUN_NAME, BenchError, Daemon, start_daemon, start_launcher, stop_daemon
from .context import Ctx

HOT, RESTART = "ddpd (hot)", "ddpd (restart)"
CHECKPOINT_EVERY = 50
ENDLESS = 10**7
KILL_AFTER = 120  # steps rank 1 trains before it is killed (past a checkpoint, between two)
POOL_SIZE = 4  # the daemon's default


def progress_of(rank: int, attempt: int, after: int) -> Callable[[EventView], bool]:
    return lambda e: (e.kind == "rank.progress" and e.rank == rank and e.attempt == attempt
                      and int(e.data.get("step", 0)) > after)


async def pool_ready(d: Daemon, n: int) -> None:
    """The pool holds `n` ready interpreters again (the last repetition's refill is done)."""
    with anyio.fail_after(300):
        while True:  # the daemon says nothing when its pool fills: asked five times a second
            if ((await d.client.daemon_info()).pool_ready or 0) >= n:
                return
            await anyio.sleep(0.2)


async def ddpd_run(ctx: Ctx, d: Daemon, hot: bool) -> tuple[float, float]:
    spec = JobSpec(name="bench-hot-replace", task="mlp", nproc=2, steps=ENDLESS, options={"width": 512},
                   checkpoint_every=CHECKPOINT_EVERY, **({} if hot else {"hot_replace": 0, "max_restarts": 1}))
    await pool_ready(d, POOL_SIZE)
    job_id = await d.client.submit(spec)
    try:
        for r in (0, 1):
            await d.events.wait(job_id, progress_of(r, 1, KILL_AFTER), timeout=120)
        view = await d.client.status(job_id)
        pid = view.ranks[1].pid
        if pid is None:
            raise BenchError(f"status of {job_id} lacks rank 1's pid")
        at_kill = max(r.step for r in view.ranks)
        t_kill = time.perf_counter()
        os.kill(pid, signal.SIGKILL)
        if hot:
            _, replaced = await d.events.wait(job_id, lambda e: e.kind == "rank.replaced", timeout=60)
            resumed, attempt = int(replaced.data["step"]), 1
        else:
            _, first = await d.events.wait(job_id, progress_of(0, 2, 0), timeout=120)
            resumed, attempt = int(first.data["step"]) - 1, 2
        done = [(await d.events.wait(job_id, progress_of(r, attempt, resumed), timeout=120))[0] for r in (0, 1)]
        return max(done) - t_kill, float(max(0, at_kill - resumed))
    finally:
        await d.client.cancel(job_id, force=True)
        with anyio.fail_after(60):
            await d.client.wait(job_id)


async def torchrun_run(ctx: Ctx) -> tuple[float, float]:
    run_dir = Path(ctx.base) / f"torchrun-ckpt-{time.monotonic_ns()}"
    run_dir.mkdir()
    run = await start_launcher(TORCHRUN_NAME, ctx.base, [
        "--task", "mlp", "--width", "512", "--steps", str(ENDLESS), "--checkpoint-every", str(CHECKPOINT_EVERY),
        "--checkpoint", str(run_dir / "ckpt.pt")], extra=["--max-restarts", "1"])
    try:
        with anyio.fail_after(120):
            while True:
                stamps = run.read_stamps()
                if len(stamps) == 2 and all(int(s.get("step", 0)) >= KILL_AFTER for s in stamps.values()):
                    break
                if run.proc.returncode is not None:
                    raise BenchError(f"torchrun exited with {run.proc.returncode}:\n{run.log_tail()}")
                await anyio.sleep(0.01)
        at_kill = max(int(s["step"]) for s in stamps.values())
        t_kill = time.time()  # the ranks stamp wall-clock times
        os.kill(int(stamps[1]["pid"]), signal.SIGKILL)
        with anyio.fail_after(120):
            while True:  # every rank of the restarted workers has taken a step
                stamps = run.read_stamps()
                again = [s for s in stamps.values() if int(s.get("restart", 0)) >= 1 and "first_step_at" in s]
                if len(again) == 2:
                    break
                if run.proc.returncode is not None:
                    raise BenchError(f"torchrun exited with {run.proc.returncode}:\n{run.log_tail()}")
                await anyio.sleep(0.01)
        resumed = int(again[0]["resumed_from"])
        trained_again = max(float(s["first_step_at"]) for s in again)
        return trained_again - t_kill, float(max(0, at_kill - resumed))
    finally:
        run.kill()


async def bench_hot_replace(ctx: Ctx) -> None:
    ctx.console.print(f"[bold]hot rank replacement[/bold] (rank 1 of 2 SIGKILLed after {KILL_AFTER} steps of mlp "
                      f"width 512; restarts resume from a checkpoint every {CHECKPOINT_EVERY} steps)")
    back = ctx.results.metric("hot_replace", "hot replacement", "SIGKILL → every rank training again", "s")
    lost = ctx.results.metric("hot_replace_lost", "hot replacement", "steps lost", "steps")
    d = await start_daemon(ctx.base, "ddpd-hot", config={"pool_size": POOL_SIZE})
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(d.follow_events)
            runners: list[tuple[str, Callable[[], Awaitable[tuple[float, float]]]]] = [
                (HOT, partial(ddpd_run, ctx, d, True)),
                (RESTART, partial(ddpd_run, ctx, d, False)),
                (TORCHRUN_NAME, partial(torchrun_run, ctx)),
            ]

            def record(name: str, value: tuple[float, float]) -> str:
                back.add(name, value[0])
                lost.add(name, value[1])
                return f"training again {value[0]:.3f}s  steps lost {value[1]:.0f}"

            await ctx.alternate(ctx.plan.detect_reps + 1, runners, record)
            tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            rc = await stop_daemon(d)
            if rc != 0:
                ctx.results.errors.append(f"daemon {d.name} exited with {rc}:\n{d.log_tail(10)}")
