"""Hot rank replacement: rank 1 dies (SIGKILL) mid-training; how long until every rank trains again,
and how many steps were lost, for three ways of surviving it (alternating, one job each per repetition):

  - ``ddpd (hot)``: the mlp task (width 512) with its default hot replacement, on a daemon with the
    default warm pool (a fork server: the job's 2 ranks forked ahead, the replacement forked at once;
    with ``pool_fork_server = false``, 4 interpreters: a 2-rank job leaves two spare ones). Until
    every rank has reported a step after the one the group resumed at (``rank.replaced``, then ``rank.progress``).
  - ``ddpd (restart)``: the same job with ``hot_replace=0``, ``max_restarts=1`` and a checkpoint every
    CHECKPOINT_EVERY steps: the attempt fails, the next one resumes from the checkpoint. Until every
    rank of attempt 2 has reported a step.
  - ``torchrun``: ``--max-restarts 1`` and benchmarks/ddp_script.py with the same checkpoint every
    CHECKPOINT_EVERY steps: torchrun restarts every worker; until every rank has stamped its first
    step after the restart.

Rank 1 kills itself at the start of step KILL_AT, once (benchmarks/killed_task.py; ddp_script.py's
``--kill-at``), after writing the time: the clock starts there. Its peer cannot have finished step
KILL_AT (the step's gradients need rank 1), so KILL_AT - 1 steps were done; steps lost are those
minus the step training resumed from (the step in flight, redone, is not a lost one).
"""

from __future__ import annotations

import re
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import anyio

from ddpd.protocol import JobSpec
from ddpd.protocol.control import EventView

from .common import REPO, TORCHRUN_NAME, BenchError, Daemon, start_daemon, stop_daemon
from .context import Ctx
from .launchers import start_launcher

HOT, RESTART = "ddpd (hot)", "ddpd (restart)"
CHECKPOINT_EVERY = 50
ENDLESS = 10**7
KILL_AT = 120  # the step rank 1 dies at (past a checkpoint, between two)
POOL_SIZE = 4  # the daemon's default
WIDTH = 512


def progress_of(rank: int, attempt: int, after: int) -> Callable[[EventView], bool]:
    return lambda e: (e.kind == "rank.progress" and e.rank == rank and e.attempt == attempt
                      and int(e.data.get("step", 0)) > after)


async def pool_ready(d: Daemon, n: int, ranks: int = 2) -> None:
    """The pool can give the job's ranks and a replacement without a cold start again (the last
    repetition's refill is done): a ready fork server with the last job's `ranks` forked ahead (the
    default), or `n` ready interpreters (``pool_fork_server = false``)."""
    with anyio.move_on_after(240):
        while True:  # the daemon says nothing when its pool fills: asked five times a second
            info = await d.client.daemon_info()
            forked = re.match(r"warm \(\d+ fork servers? ready, (\d+) forked", info.pool_state or "")
            if (int(forked.group(1)) >= ranks) if forked else (info.pool_ready or 0) >= n:
                return
            await anyio.sleep(0.2)
    raise BenchError(f"the warm pool could not give {n} ranks within 240 s: {info.pool_state}")


async def killed_at(marker: Path) -> float:
    """The wall-clock time rank 1 wrote just before it killed itself."""
    with anyio.fail_after(120):
        while True:
            try:
                return float(await anyio.Path(marker).read_text())
            except (FileNotFoundError, ValueError):
                await anyio.sleep(0.01)


def scratch(ctx: Ctx, name: str) -> Path:
    path = Path(ctx.base) / f"{name}-{time.monotonic_ns()}"
    path.mkdir()
    return path


async def ddpd_run(ctx: Ctx, d: Daemon, hot: bool) -> tuple[float, float]:
    marker = scratch(ctx, "hot" if hot else "restart") / "killed"
    restart: dict[str, Any] = {} if hot else {"hot_replace": 0, "max_restarts": 1}
    spec = JobSpec(name="bench-hot-replace", task="benchmarks.killed_task:make", workdir=str(REPO), nproc=2,
                   steps=ENDLESS, options={"width": WIDTH, "kill_at": KILL_AT, "marker": str(marker)},
                   checkpoint_every=CHECKPOINT_EVERY, **restart)
    await pool_ready(d, POOL_SIZE)
    job_id = await d.client.submit(spec)
    try:
        t_kill = await killed_at(marker)
        if hot:
            _, replaced = await d.events.wait(job_id, lambda e: e.kind == "rank.replaced", timeout=60)
            resumed, attempt = int(replaced.data["step"]), 1
            if not replaced.data.get("pooled"):
                ctx.say("  (the replacement started cold: the pool held no spare)")
        else:
            _, first = await d.events.wait(job_id, progress_of(0, 2, 0), timeout=120)
            resumed, attempt = int(first.data["step"]) - 1, 2
        arrived = [(await d.events.wait(job_id, progress_of(r, attempt, resumed), timeout=120))[1] for r in (0, 1)]
        again = max(e.ts for e in arrived)  # the daemon's wall clock as it recorded the events
        return again - t_kill, float(KILL_AT - 1 - resumed)
    finally:
        await d.client.cancel(job_id, force=True)
        with anyio.fail_after(60):
            await d.client.wait(job_id)


async def torchrun_run(ctx: Ctx) -> tuple[float, float]:
    run_dir = scratch(ctx, "torchrun-ckpt")
    marker = run_dir / "killed"
    run = await start_launcher(TORCHRUN_NAME, ctx.base, [
        "--task", "mlp", "--width", str(WIDTH), "--steps", str(ENDLESS), "--checkpoint-every", str(CHECKPOINT_EVERY),
        "--checkpoint", str(run_dir / "ckpt.pt"), "--kill-at", str(KILL_AT), "--kill-marker", str(marker)],
        extra=["--max-restarts", "1"])
    try:
        t_kill = await killed_at(marker)
        with anyio.fail_after(120):
            while True:  # every rank of the restarted workers has taken a step
                stamps = run.read_stamps()
                again = [s for s in stamps.values() if int(s.get("restart", 0)) >= 1 and "first_step_at" in s]
                if len(again) == 2:
                    break
                if run.proc.returncode is not None:
                    raise BenchError(f"torchrun exited with {run.proc.returncode}:\n{run.log_tail(150)}")
                await anyio.sleep(0.01)
        resumed = int(again[0]["resumed_from"])
        return max(float(s["first_step_at"]) for s in again) - t_kill, float(KILL_AT - 1 - resumed)
    finally:
        run.kill()


async def bench_hot_replace(ctx: Ctx) -> None:
    ctx.console.print(f"[bold]hot rank replacement[/bold] (rank 1 of 2 SIGKILLed at step {KILL_AT} of mlp width "
                      f"{WIDTH}; restarts resume from a checkpoint every {CHECKPOINT_EVERY} steps)")
    back = ctx.results.metric("hot_replace", "hot replacement", "SIGKILL → every rank training again", "s")
    lost = ctx.results.metric("hot_replace_lost", "hot replacement", "steps lost", "steps")
    d = await start_daemon(ctx.base, "ddpd-hot", config={"pool_size": POOL_SIZE})
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(d.follow_events)
            # the pool keeps interpreters for a shape once a job of it has run: one short job first
            first = await d.client.submit(JobSpec(name="bench-warmup", task="mlp", nproc=2, steps=5,
                                                  options={"width": WIDTH}))
            with anyio.fail_after(300):
                warm = await d.client.wait(first)
            if warm.state != "SUCCEEDED":
                raise BenchError(f"the warm-up job ended {warm.state}:\n{d.log_tail()}")
            runners: list[tuple[str, Callable[[], Awaitable[tuple[float, float]]]]] = [
                (HOT, partial(ddpd_run, ctx, d, True)),
                (RESTART, partial(ddpd_run, ctx, d, False)),
                (TORCHRUN_NAME, partial(torchrun_run, ctx)),
            ]

            def record(name: str, value: tuple[float, float]) -> str:
                back.add(name, value[0])
                lost.add(name, value[1])
                return f"training again {value[0]:.3f}s  steps lost {value[1]:.0f}"

            await ctx.alternate(ctx.plan.detect_reps + 1, runners, record, [back, lost], daemons=[d])
            tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            rc = await stop_daemon(d)
            if rc != 0:
                ctx.results.errors.append(f"daemon {d.name} exited with {rc}:\n{d.log_tail(10)}")
