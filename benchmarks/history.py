"""The daemon with a long history: start-up time (to the first answered ping) and resident memory with
100,000 ended jobs in its state database (10,000 with ``--short``), against an empty history.

The history is written straight into a state database (jobs, their ranks, attempts and events, as the
daemon writes them), so the figure measures recovery and what the daemon keeps in memory, not a
hundred thousand runs.
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import anyio
import anyio.to_thread
import msgspec

from ddpd.daemon.store.state import StateDB
from ddpd.protocol import JobSpec

from .common import DDPD, rss_mib, start_daemon, stop_daemon
from .context import Ctx

EVENTS_PER_JOB = 6
RANKS_PER_JOB = 2


def fill_history(state_dir: Path, jobs: int) -> None:
    """`jobs` ended jobs (SUCCEEDED), each with its ranks, one attempt and its events."""
    state_dir.mkdir(parents=True, exist_ok=True)
    StateDB(state_dir / "ddpd.db").close()  # the daemon's own schema
    spec = msgspec.json.encode(JobSpec(name="history", task="two-layer", nproc=RANKS_PER_JOB, steps=20,
                                       workdir="/srv/project")).decode()
    now = time.time() - 3600
    with sqlite3.connect(state_dir / "ddpd.db") as conn:
        conn.execute("PRAGMA synchronous=OFF")
        conn.executemany(
            "INSERT INTO jobs (id, seq, name, owner_uid, spec, state, attempt, priority, submitted_at, started_at, "
            "finished_at, reason) VALUES (?, ?, 'history', 1000, ?, 'SUCCEEDED', 1, 0, ?, ?, ?, "
            "'all ranks succeeded')",
            ((f"j{i}-0000", i, spec, now + i * 1e-3, now + i * 1e-3 + 1, now + i * 1e-3 + 5)
             for i in range(1, jobs + 1)))
        conn.executemany(
            "INSERT INTO ranks (job_id, attempt, rank, state, pid, pgid, step, exit_code, log) "
            "VALUES (?, 1, ?, 'EXITED', 4242, 4242, 20, 0, ?)",
            ((f"j{i}-0000", r, f"{state_dir}/jobs/j{i}-0000/attempt-1/rank-{r}.log")
             for i in range(1, jobs + 1) for r in range(RANKS_PER_JOB)))
        conn.executemany(
            "INSERT INTO attempts (job_id, attempt, pgid, store_port, token, started_at) VALUES (?, 1, 4242, 0, "
            "'0123456789abcdef', ?)", ((f"j{i}-0000", now) for i in range(1, jobs + 1)))
        data = json.dumps({"from": "RUNNING", "to": "SUCCEEDED", "reason": "all ranks succeeded"})
        conn.executemany(
            "INSERT INTO events (ts, job_id, attempt, rank, kind, data) VALUES (?, ?, 1, NULL, 'job.state_changed', ?)",
            ((now, f"j{i}-0000", data) for i in range(1, jobs + 1) for _ in range(EVENTS_PER_JOB)))


async def start_with_history(ctx: Ctx, name: str, jobs: int) -> tuple[float, float]:
    """(seconds from exec to the first answered ping, resident MiB once ready) of a daemon over `jobs`."""
    state = ctx.base / f"{name}-state"
    await anyio.to_thread.run_sync(fill_history, state, jobs)
    t0 = time.perf_counter()
    d = await start_daemon(ctx.base, name, flags=["--state-dir", str(state), "--gpus", "0", "--pool-size", "0"])
    seconds = time.perf_counter() - t0
    try:
        jobs_seen = len(await d.client.list_jobs(limit=10))
        if jobs and jobs_seen == 0:
            raise RuntimeError(f"{name}: the daemon lists no job of its history")
        return seconds, rss_mib(d.proc.pid)
    finally:
        with anyio.CancelScope(shield=True):
            rc = await stop_daemon(d)
            if rc != 0:
                ctx.results.errors.append(f"{name} exited with {rc}:\n{d.log_tail(10)}")


async def bench_history(ctx: Ctx) -> None:
    jobs = 10_000 if ctx.plan.short else 100_000
    reps = 1 if ctx.plan.short else 3
    ctx.console.print(f"[bold]history[/bold] (start-up and memory with {jobs:,} ended jobs, {reps} start(s) each)")
    res = ctx.results
    for label, n in (("empty history", 0), (f"{jobs:,} ended jobs", jobs)):
        for rep in range(reps):
            seconds, rss = await start_with_history(ctx, f"ddpd-history-{n}-{rep}", n)
            res.metric(f"history_start_{n}", "history", f"{label}: exec to first ping", "s").add(DDPD, seconds)
            res.metric(f"history_rss_{n}", "history", f"{label}: resident memory when ready", "MiB").add(DDPD, rss)
            ctx.say(f"  {label} rep {rep + 1}/{reps}: ready in {seconds:.2f} s, {rss:.0f} MiB resident")
