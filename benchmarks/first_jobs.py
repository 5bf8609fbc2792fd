"""``python -m benchmarks.first_jobs [--rounds N] [--jobs J] [--json PATH]``: a key's first jobs,
back to back, while its fork server starts.

Each round uses a key new to every daemon (its environment differs from every earlier round's in
one start-up variable, ``PYTHONWARNINGS``, which every side gets alike) and runs `J` classic
two-layer jobs (2 ranks, 20 steps, submitted as ``ddpctl submit`` sends them) one after another,
each submitted when the previous one ended, on four sides:

- **through**: the default config: the first job's ranks wait for the key's server, which starts
  at that job's start, and are forked by it once it is ready (``pool_server_wait``);
- **beside**: ``pool_server_wait = 0``: the first job starts cold beside its key's server;
- **cold**: ``pool_size = 0``: every rank a fresh interpreter;
- **torchrun**: the same program under torchrun, the same `J` runs back to back.

Each job is timed from submit to SUCCEEDED (torchrun: start to exit). Reported per side: the first
job's seconds, the later jobs' median, and the whole series' sum, with medians and ranges over the
rounds, and each ddpd side's sums over torchrun's sum of the same round. Every side is treated
alike: the sides' order rotates from round to round, and before each side the daemons' pools are
idle and the machine quiet (benchmarks/settle.py; a side that never got a quiet machine is counted
as unsettled). No run is retried or dropped: a failed job fails its side's round, counted with why.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

from .common import TORCHRUN_NAME, BenchError, Daemon, start_daemon, stop_daemon
from .pool import STEPS, as_ddpctl, timed_job, timed_launcher
from .settle import settle

CONFIGS: dict[str, dict[str, Any]] = {"through": {}, "beside": {"pool_server_wait": 0}, "cold": {"pool_size": 0}}
SIDES = (*CONFIGS, TORCHRUN_NAME)


async def series(side: str, daemons: dict[str, Daemon], base: Path, jobs: int) -> tuple[list[float], list[bool]]:
    """`jobs` runs of `side` back to back: each one's seconds, and for ddpd whether all its ranks were pooled."""
    seconds: list[float] = []
    pooled: list[bool] = []
    for _ in range(jobs):
        if side == TORCHRUN_NAME:
            seconds.append(await timed_launcher(base, side))
            continue
        took, warm = await timed_job(daemons[side], as_ddpctl(task="two-layer", steps=STEPS))
        seconds.append(took)
        pooled.append(warm)
    return seconds, pooled


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


async def measure(rounds: int, jobs: int) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    failed: dict[str, list[str]] = {}
    unsettled: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="ddpd-first-") as tmp:
        base = Path(tmp)
        daemons: dict[str, Daemon] = {}
        try:
            for name, config in CONFIGS.items():
                daemons[name] = await start_daemon(base, name, config=config or None)
            async with anyio.create_task_group() as tg:
                for d in daemons.values():
                    await tg.start(d.follow_events)
                for n in range(rounds):
                    os.environ["PYTHONWARNINGS"] = f"default::UserWarning:ddpd_first_jobs_{os.getpid()}_{n}"
                    row: dict[str, Any] = {"round": n + 1}
                    for side in SIDES[n % len(SIDES):] + SIDES[:n % len(SIDES)]:
                        settled = await settle(daemons.values())
                        if not settled.quiet:
                            unsettled[side] = unsettled.get(side, 0) + 1
                        try:
                            seconds, pooled = await series(side, daemons, base, jobs)
                        except BenchError as exc:
                            failed.setdefault(side, []).append(f"round {n + 1}: {exc}")
                            print(f"round {n + 1} {side:8} FAILED: {exc}", flush=True)
                            continue
                        row[side] = {"seconds": [round(s, 3) for s in seconds], "pooled": pooled}
                        print(f"round {n + 1} {side:8} " + " ".join(f"{s:.2f}" for s in seconds)
                              + (f" pooled {''.join('P' if p else '-' for p in pooled)}" if pooled else "")
                              + f" ({settled.text()})", flush=True)
                    rows.append(row)
                tg.cancel_scope.cancel()
        finally:
            os.environ.pop("PYTHONWARNINGS", None)
            with anyio.CancelScope(shield=True):
                for d in daemons.values():
                    await stop_daemon(d)
    return {"rounds": rows, "summary": summarize(rows), "failed": failed, "unsettled": unsettled,
            "jobs": jobs, "cores": len(os.sched_getaffinity(0))}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for side in SIDES:
        done = [r[side]["seconds"] for r in rows if side in r]
        if not done:
            continue
        out[side] = {"first": spread([s[0] for s in done]), "sum": spread([sum(s) for s in done])}
        if len(done[0]) > 1:
            out[side]["later"] = spread([statistics.median(s[1:]) for s in done])
        if side != TORCHRUN_NAME:
            ratio = [sum(r[side]["seconds"]) / sum(r[TORCHRUN_NAME]["seconds"]) for r in rows
                     if side in r and TORCHRUN_NAME in r]
            if ratio:
                out[f"{side} sum / {TORCHRUN_NAME} sum"] = spread(ratio)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.first_jobs", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--jobs", type=int, default=5)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    started = time.perf_counter()
    result = anyio.run(measure, args.rounds, args.jobs)
    result["seconds"] = round(time.perf_counter() - started, 1)
    text = json.dumps(result["summary"], indent=2)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0 if not result["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
