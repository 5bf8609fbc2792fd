"""The fork server against the pool of whole interpreters (``--only forkserver``; docs/pool.md).

Two daemons, each with ``cpu_slots = 8``: ``ddpd (interpreters)`` with the default pool (whole
interpreters, 4 in all) and ``ddpd (fork server)`` with ``pool_fork_server = true`` (one server per
key). Each learns the daemon's own key at start and runs one unmeasured 2-rank job first. Then,
alternating the two in every repetition, each after the same settle (benchmarks/context.py):

- **8 ranks**: the classic two-layer task with 8 ranks, submit → RUNNING (the ``job.state_changed``
  event to RUNNING, sent when the last rank joined).
- **back to back, rank 1 killed**: a 2-rank mlp job (width 512) runs to its end, and at once the same
  job again (``benchmarks.killed_task``), whose rank 1 kills itself at step KILL_AT; from the time
  it wrote just before until every rank reports a step after the one the group resumed at
  (``rank.replaced``, then ``rank.progress``), and the steps lost. The refills of the interpreter
  pool are behind the first job then: the case of a busy box.
- **a new key** (fork server daemon only): a 2-rank classic job with a start-up variable no job had
  in its submitted environment (``TORCH_DDPD_BENCH_KEY``: a new pool key), whose ranks wait for
  their key's server, started at the job's start, and are forked by it (``pool_server_wait``):
  submit → RUNNING; the server's own start (spawned → ready, its ``pool.worker_ready`` line); and
  the key's next job, submit → RUNNING. (``benchmarks.first_jobs`` compares a key's first jobs
  through its server with the same jobs cold beside it, cold without a pool, and under torchrun.)
- **memory**: after the 8-rank repetitions, the proportional memory (Pss, smaps_rollup) of one
  pool interpreter (the fork server), and of the key's whole pool: the ready interpreters, or the
  server and the spares it forked ahead (as many as the last job's ranks: 8).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path

import anyio

from ddpd.protocol import JobSpec

from .common import FINAL, REPO, BenchError, Daemon, start_daemon, state_is, stop_daemon, why
from .context import Ctx
from .hot_replace import ENDLESS, KILL_AT, WIDTH, killed_at, progress_of, scratch
from .pool import _pss_mib, pool_pids

INTERP, FORK = "ddpd (interpreters)", "ddpd (fork server)"
RANKS = 8


async def finished(d: Daemon, job_id: str) -> None:
    _, event = await d.events.wait(job_id, state_is(*FINAL), timeout=300)
    if event.data.get("to") != "SUCCEEDED":
        view = await d.client.status(job_id)
        raise BenchError(f"{d.name}: job {job_id} ended {view.state}: {why(view.root_cause)}\n{d.log_tail()}")


async def running_after(d: Daemon) -> float:
    """Submit → RUNNING of an 8-rank classic job (then its end is awaited)."""
    t0 = time.perf_counter()  # the event log's clock
    job_id = await d.client.submit(JobSpec(name="bench-8", task="two-layer", nproc=RANKS, steps=20,
                                           workdir=str(REPO)))
    t_running, running = await d.events.wait(job_id, state_is("RUNNING", *FINAL), timeout=300)
    if running.data.get("to") != "RUNNING":
        raise BenchError(f"{d.name}: the 8-rank job ended {running.data.get('to')} before RUNNING")
    seconds = t_running - t0
    await finished(d, job_id)
    return seconds


async def replaced_after(ctx: Ctx, d: Daemon) -> tuple[float, float]:
    """A job to its end, then at once the same job with rank 1 killed: (seconds until every rank
    trains again, steps lost)."""
    first = await d.client.submit(JobSpec(name="bench-before", task="mlp", nproc=2, steps=30,
                                          options={"width": WIDTH}, workdir=str(REPO)))
    await finished(d, first)
    marker = scratch(ctx, "forkserver") / "killed"
    job_id = await d.client.submit(JobSpec(name="bench-killed", task="benchmarks.killed_task:make", nproc=2,
                                           steps=ENDLESS, workdir=str(REPO),
                                           options={"width": WIDTH, "kill_at": KILL_AT, "marker": str(marker)}))
    try:
        t_kill = await killed_at(marker)
        _, replaced = await d.events.wait(job_id, lambda e: e.kind == "rank.replaced", timeout=60)
        resumed = int(replaced.data["step"])
        if not replaced.data.get("pooled"):
            ctx.say(f"  ({d.name}: the replacement started cold)")
        arrived = [(await d.events.wait(job_id, progress_of(r, 1, resumed), timeout=120))[1] for r in (0, 1)]
        return max(e.ts for e in arrived) - t_kill, float(KILL_AT - 1 - resumed)
    finally:
        await d.client.cancel(job_id, force=True)
        with anyio.fail_after(60):
            await d.client.wait(job_id)


def _log_events(d: Daemon, name: str) -> list[dict[str, object]]:
    found = []
    for line in d.log_path.read_text(errors="replace").splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if e.get("event") == name:
            found.append(e)
    return found


async def server_started(d: Daemon, before: int) -> float:
    """Seconds from the spawn of the next fork server after the first `before` ready lines to its
    ready line (the log is read until it is there, bounded)."""
    with anyio.fail_after(60):
        while True:
            ready = [e for e in _log_events(d, "pool.worker_ready") if e.get("server")]
            if len(ready) > before:
                return float(ready[before]["seconds"])  # type: ignore[arg-type]
            await anyio.sleep(0.05)


async def new_key_after(d: Daemon) -> tuple[float, float, float]:
    """A new key's first job (through its server, which starts with it), its server's start, and the
    key's next job: three submit → RUNNING or start times, in seconds."""
    servers = len([e for e in _log_events(d, "pool.worker_ready") if e.get("server")])
    # a key is the user, the interpreter and the submitted environment's start-up variables (as
    # ddpctl sends them; a spec without them takes the daemon's own, one key)
    spec = JobSpec(name="bench-newkey", task="two-layer", nproc=2, steps=20, workdir=str(REPO), python=sys.executable,
                   environ={**os.environ, "TORCH_DDPD_BENCH_KEY": str(time.time_ns())})
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        job_id = await d.client.submit(spec)
        t_running, running = await d.events.wait(job_id, state_is("RUNNING", *FINAL), timeout=300)
        if running.data.get("to") != "RUNNING":
            raise BenchError(f"{d.name}: the new key's job ended {running.data.get('to')} before RUNNING")
        times.append(t_running - t0)
        await finished(d, job_id)
        if len(times) == 1:
            server = await server_started(d, servers)
    return times[0], server, times[1]


def spare_pids(d: Daemon) -> list[int]:
    """Workers a fork server forked ahead and no job took: alive, and still in a pool cgroup."""
    found = []
    for e in _log_events(d, "pool.forked"):
        if e.get("spare"):
            try:
                if "/pool-" in Path(f"/proc/{e['pid']}/cgroup").read_text():
                    found.append(int(str(e["pid"])))
            except OSError:
                continue
    return found


def record_memory(ctx: Ctx, daemons: dict[str, Daemon]) -> None:
    """The Pss of each pool's processes: one interpreter (or the server), and the key's whole pool
    (the ready interpreters, or the server and its spares, as many as the last 8-rank job had)."""
    one = ctx.results.metric("forkserver_pss", "fork server", "Pss of one pool interpreter (server)", "MiB")
    per_key = ctx.results.metric("forkserver_pss_key", "fork server", "Pss of the key's pool", "MiB")
    for name, d in daemons.items():
        pss = [_pss_mib(pid) for pid in pool_pids(d)]
        spares = [_pss_mib(pid) for pid in spare_pids(d)]
        if pss:
            one.add(name, statistics.median(pss))
            per_key.add(name, sum(pss) + sum(spares))
            ctx.say(f"  {name}: {len(pss)} pool interpreter(s), Pss {', '.join(f'{p:.0f}' for p in pss)} MiB; "
                    f"{len(spares)} spare(s), Pss {sum(spares):.0f} MiB in all")


async def bench_forkserver(ctx: Ctx) -> None:
    ctx.console.print(f"[bold]fork server[/bold] ({RANKS}-rank job submit → RUNNING; back to back, rank 1 of 2 "
                      f"killed at step {KILL_AT}; memory)")
    start = ctx.results.metric("forkserver_running", "fork server", f"{RANKS} ranks: submit → RUNNING", "s")
    back = ctx.results.metric("forkserver_replace", "fork server", "back to back: SIGKILL → training again", "s")
    lost = ctx.results.metric("forkserver_lost", "fork server", "back to back: steps lost", "steps")
    cold = ctx.results.metric("forkserver_newkey", "fork server", "a new key's first job: submit → RUNNING", "s")
    server = ctx.results.metric("forkserver_server_start", "fork server", "its server: spawned → ready", "s")
    warm = ctx.results.metric("forkserver_newkey_next", "fork server", "the key's next job: submit → RUNNING", "s")
    daemons: dict[str, Daemon] = {}
    try:
        daemons[INTERP] = await start_daemon(ctx.base, "ddpd-interp", config={"cpu_slots": RANKS,
                                                                            "pool_fork_server": False})
        daemons[FORK] = await start_daemon(ctx.base, "ddpd-fork", config={"cpu_slots": RANKS,
                                                                          "pool_fork_server": True})
        async with anyio.create_task_group() as tg:
            for d in daemons.values():
                await tg.start(d.follow_events)
            for d in daemons.values():  # the key's first job (its pool warm from then on)
                await finished(d, await d.client.submit(JobSpec(name="bench-warmup", task="two-layer", nproc=2,
                                                                steps=20, workdir=str(REPO))))
            reps = ctx.plan.launch_reps if ctx.plan.short else max(10, ctx.plan.launch_reps)  # the 10
            runners: list[tuple[str, Callable[[], Awaitable[float]]]] = [
                (name, partial(running_after, d)) for name, d in daemons.items()]

            def started(name: str, value: float) -> str:
                start.add(name, value)
                return f"RUNNING after {value:.3f}s"

            await ctx.alternate(reps, runners, started, [start], daemons=list(daemons.values()))
            await ctx.settle(list(daemons.values()))
            record_memory(ctx, daemons)  # 8 ranks' worth ready: 8 spares beside the server

            def record(name: str, value: tuple[float, float]) -> str:
                back.add(name, value[0])
                lost.add(name, value[1])
                return f"training again {value[0]:.3f}s  steps lost {value[1]:.0f}"

            hot: list[tuple[str, Callable[[], Awaitable[tuple[float, float]]]]] = [
                (name, partial(replaced_after, ctx, d)) for name, d in daemons.items()]
            await ctx.alternate(reps, hot, record, [back, lost], daemons=list(daemons.values()))

            def record_key(name: str, value: tuple[float, float, float]) -> str:
                cold.add(name, value[0])
                server.add(name, value[1])
                warm.add(name, value[2])
                return (f"first job {value[0]:.3f}s (its server ready {value[1]:.3f}s after its spawn); "
                        f"next job {value[2]:.3f}s")

            await ctx.alternate(reps, [(FORK, partial(new_key_after, daemons[FORK]))], record_key,
                                [cold, server, warm], daemons=list(daemons.values()))
            tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            for d in daemons.values():
                rc = await stop_daemon(d)
                if rc != 0:
                    ctx.results.errors.append(f"daemon {d.name} exited with {rc}:\n{d.log_tail(10)}")

