"""Back to back: the bare loop (benchmarks/loop.py ``--bare``) as an unmodified script, each job
submitted when the previous one ended, the way people submit.

    python -m benchmarks.loop --back-to-back --rounds 5      # both models, 5 rounds each

Three sides, alternating (the order reverses between rounds): a default-config daemon (``pooled``:
each job takes pooled interpreters while the pool refills behind it), a daemon without a pool
(``cold``), and the same file under torchrun. Each side runs a short job, then at once a long one:
under ddpd the short job emptied the pool, which refills while the long one trains. Two rates per
side: the long run's steps per second on rank 0's clock from the short run's step count on
(whatever runs beside the job, a refill, counts; start-up does not), and the difference of the two
runs' wall times (submit to SUCCEEDED; torchrun's whole run) over the difference of their steps,
which a loaded machine's start-up noise swamps. On the tiny model (2 x Linear(32), batch 8) and on
4 x Linear(1024), batch 64.

Every side is treated alike: before each side the pooled daemon's pool is full again and idle and
the machine quiet (benchmarks/settle.py; a side measured on a machine that never got quiet is
counted as unsettled); no run is retried and none is dropped: a side whose job or torchrun fails
is counted as failed, with why, and that round's ratios leave it out.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import anyio

from .settle import settle

LOOP = Path(__file__).resolve().with_name("loop.py")
REPO = LOOP.parent.parent
# (label, layers, width, batch, short steps, long steps)
MODELS = (("tiny", 2, 32, 8, 200, 4200), ("4x1024", 4, 1024, 64, 20, 220))
B2B_SIDES = ("pooled", "cold", "torchrun")
POOL_SETTLE = 120.0  # seconds the pooled daemon's refill may take before a side starts


class SideFailed(RuntimeError):
    """A side's job or torchrun did not succeed (counted, with this text, never retried)."""


def b2b_argv(layers: int, width: int, batch: int, steps: int, warmup: int, stamps: Path) -> list[str]:
    return ["--bare", "--layers", str(layers), "--width", str(width), "--batch", str(batch), "--steps", str(steps),
            "--warmup", str(warmup), "--stamps", str(stamps)]


def read_clock(stamps: Path) -> float:
    from benchmarks.loop import read_clock as read

    return read(stamps)


async def b2b_job(daemon: Any, argv: list[str], nproc: int) -> float:
    """Seconds from submit to SUCCEEDED of the bare loop as a script job."""
    from ddpd.protocol import JobSpec, JobState

    started = time.perf_counter()
    job_id = await daemon.client.submit(JobSpec(name="bench-b2b", script=[str(LOOP), *argv], nproc=nproc,
                                                workdir=str(REPO)))
    with anyio.fail_after(600):
        job = await daemon.client.wait(job_id)
    if job.state != JobState.SUCCEEDED:
        raise SideFailed(f"ddpd script job {job_id} {job.state}: {job.reason} {job.root_cause}")
    return time.perf_counter() - started


def b2b_torchrun(argv: list[str], nproc: int) -> float:
    """Seconds of a whole torchrun of the bare loop (its launch included, as a job's is)."""
    from benchmarks.common import TORCHRUN, free_port

    started = time.perf_counter()
    full = [TORCHRUN, "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port",
            str(free_port()), str(LOOP), *argv]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc))}
    torchrun_once(full, env)
    return time.perf_counter() - started


def torchrun_once(argv: list[str], env: dict[str, str]) -> None:
    """Run torchrun once; a run that fails is a failed side (SideFailed with torchrun's last words),
    as a failed ddpd job is: it was retried once before, silently in the figures, and ddpd's never."""
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False,
                          start_new_session=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [""])[-1][:300]
        raise SideFailed(f"torchrun exited with {done.returncode}: {last}")


async def pool_settled(daemon: Any, size: int = 2) -> None:
    """Wait until the pooled daemon's warm pool holds `size` ready interpreters again and refills none
    (it may keep more than `size`, one set per kind of job it saw): a refill after
    the pooled side's jobs would otherwise run (at normal priority: that daemon has no job) during the
    next side, which is then measured on a busy machine."""
    with anyio.fail_after(POOL_SETTLE):
        while True:  # the daemon says nothing when its pool fills: asked five times a second
            info = await daemon.client.daemon_info()
            if (info.pool_ready or 0) >= size and "refilling" not in (info.pool_state or ""):
                return
            await anyio.sleep(0.2)


async def b2b_rate(side: str, daemons: dict[str, Any], model: tuple[str, int, int, int, int, int],
                   nproc: int, stamps: Path) -> tuple[float, float, bool]:
    """One side, a short then a long run back to back: the long run's steps/s on rank 0's clock (from
    step `short` on), (long - short) steps over the difference of their wall times, and whether the
    machine was quiet before it."""
    _, layers, width, batch, short, long = model
    await pool_settled(daemons["pooled"])  # every side starts with the pool full again
    settled = await settle(daemons.values())  # ... and on a quiet machine, the same for every side
    times = []
    for steps in (short, long):
        out = stamps / f"{side}-{steps}"
        out.mkdir(parents=True)
        argv = b2b_argv(layers, width, batch, steps, min(short, steps - 1), out)
        if side == "torchrun":
            times.append(b2b_torchrun(argv, nproc))
        else:
            times.append(await b2b_job(daemons[side], argv, nproc))
    wall = (long - short) / (times[1] - times[0]) if times[1] > times[0] else float("nan")
    return read_clock(stamps / f"{side}-{long}"), wall, settled.quiet


def ratios(row: dict[str, Any]) -> dict[str, Any]:
    """The round's ratios to torchrun, of the sides that ran (None where either failed)."""
    def over(a: str, b: str) -> float | None:
        return row[a] / row[b] if row.get(a) is not None and row.get(b) is not None else None

    return {"pooled_ratio": over("pooled", "torchrun"), "cold_ratio": over("cold", "torchrun"),
            "pooled_wall_ratio": over("pooled_wall", "torchrun_wall")}


async def back_to_back(rounds: int, nproc: int = 2) -> dict[str, Any]:
    """`rounds` alternating rounds per model; each side's steps/s, ddpd's ratios to torchrun, and the
    failed and unsettled runs of every side: {"models": {label: rows}, "failed": [...], "unsettled": {...}}."""
    import tempfile

    from benchmarks.common import start_daemon, stop_daemon

    slots = max(nproc, os.cpu_count() or 1)
    models: dict[str, list[dict[str, Any]]] = {}
    failed: list[dict[str, Any]] = []
    unsettled: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="ddpd-b2b-") as tmp:
        base = Path(tmp)
        # "pooled": whole warm interpreters (pool_settled counts them; the fork server has its own benchmark)
        daemons = {"pooled": await start_daemon(base, "pooled", config={"cpu_slots": slots, "pool_fork_server": False}),
                   "cold": await start_daemon(base, "cold", config={"cpu_slots": slots, "pool_size": 0})}
        try:
            for model in MODELS:
                rows = []
                for n in range(rounds):
                    row: dict[str, Any] = {}
                    for side in B2B_SIDES if n % 2 == 0 else B2B_SIDES[::-1]:
                        try:
                            row[side], row[f"{side}_wall"], quiet = await b2b_rate(
                                side, daemons, model, nproc, base / f"{model[0]}-{n}")
                        except SideFailed as exc:
                            row[side] = row[f"{side}_wall"] = None
                            failed.append({"model": model[0], "round": n + 1, "side": side, "why": str(exc)})
                            print(f"{model[0]} round {n + 1}: {side} FAILED: {exc}", flush=True)
                            continue
                        if not quiet:
                            unsettled[side] = unsettled.get(side, 0) + 1
                    row.update(ratios(row))
                    rows.append(row)
                    print(f"{model[0]} round {n + 1}: " + ", ".join(
                        f"{k} {v:.3f}" for k, v in row.items() if v is not None), flush=True)
                models[model[0]] = rows
        finally:
            for d in daemons.values():
                await stop_daemon(d)
    return {"models": models, "failed": failed, "unsettled": unsettled}


def spread(rows: list[dict[str, Any]], key: str) -> str:
    values = [r[key] for r in rows if r.get(key) is not None]
    if not values:
        return "-"
    return f"{statistics.median(values):.3f}x [{min(values):.3f}-{max(values):.3f}] n={len(values)}"


def b2b_summary(result: dict[str, Any]) -> str:
    lines = [f"back to back, {label}: ddpd/torchrun steps/s pooled {spread(rows, 'pooled_ratio')}, cold "
             f"{spread(rows, 'cold_ratio')} over {len(rows)} rounds (target >= 0.98); from wall-time "
             f"differences, pooled {spread(rows, 'pooled_wall_ratio')}" for label, rows in result["models"].items()]
    lines += [f"  FAILED {f['model']} round {f['round']} {f['side']}: {f['why']}" for f in result["failed"]]
    if result["unsettled"]:
        lines.append(f"  measured on a machine that never got quiet: {result['unsettled']}")
    return "\n".join(lines)
