"""Forked ranks' first seconds: steps/s and page faults block by block, forked against cold.

    python -m benchmarks.forked_ramp                   # 1 rank, 8 blocks of 2000 steps, 6 runs a side
    python -m benchmarks.forked_ramp --nproc 2 --runs 4

A rank the fork server forked shares the server's memory copy-on-write: each page it first writes
(the heap's free chunks it allocates from, the tables of pybind11's live instances it inserts into)
is copied then, a minor fault, and where the rank has a second thread on another core (1 rank on 2
cores: an intra-op thread) every such copy also flushes that core's TLB. A cold rank wrote those
pages while it imported. Two daemons (a fork server's, ``pool_fork_server = true``, and one
without a pool, ``pool_size = 0``) run the same unmodified script (benchmarks/ramp_loop.py: the
paired benchmark's tiny model, 200 warm-up steps, then blocks of steps), one job at a time, the
sides taking turns (the order reversed every other run), each after the same settle
(benchmarks/settle.py). Reported per block: each side's median rate and minor faults, and the
median of the per-run ratios forked / cold (run i of one side against run i of the other). Every
job that fails is counted with its reason; none is retried. CPU only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import anyio

from .common import BenchError, Daemon, start_daemon, stop_daemon, why
from .settle import settle

SCRIPT = str(Path(__file__).resolve().with_name("ramp_loop.py"))
REPO = Path(SCRIPT).parent.parent
SIDES = {"forked": {"pool_fork_server": True}, "cold": {"pool_size": 0}}
WARMUP = 200


async def one_run(d: Daemon, out: Path, nproc: int, blocks: int, steps: int) -> dict[str, Any]:
    from ddpd.protocol import JobSpec

    spec = JobSpec(name="bench-ramp", script=[SCRIPT, str(out), str(WARMUP), str(blocks), str(steps)],
                   nproc=nproc, workdir=str(REPO))
    view = await d.client.wait(await d.client.submit(spec))
    if view.state != "SUCCEEDED":
        raise BenchError(f"job {view.id} ended {view.state}: {why(view.root_cause)}")
    result: dict[str, Any] = json.loads(await anyio.Path(out).read_text())
    return result


async def ramp(runs: int, nproc: int, blocks: int, steps: int) -> dict[str, Any]:
    from .back_to_back import pool_settled

    found: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    failed: dict[str, list[str]] = {side: [] for side in SIDES}
    unsettled = 0
    with tempfile.TemporaryDirectory(prefix="ddpd-ramp-") as tmp:
        base = Path(tmp)
        daemons: dict[str, Daemon] = {}
        try:
            for side, config in SIDES.items():
                daemons[side] = await start_daemon(base, side, config={"cpu_slots": max(2, nproc), **config})
            await pool_settled(daemons["forked"], 1)  # its fork server is ready
            for n in range(runs):
                for side in (list(SIDES) if n % 2 == 0 else list(SIDES)[::-1]):
                    settled = await settle(daemons.values())
                    unsettled += not settled.quiet
                    try:
                        result = await one_run(daemons[side], base / f"{side}-{n}.json", nproc, blocks, steps)
                    except BenchError as exc:
                        failed[side].append(str(exc))
                        print(f"run {n + 1} {side}: FAILED {exc}", flush=True)
                        continue
                    found[side].append(result)
                    print(f"run {n + 1} {side}: " + " ".join(f"{r:.0f}" for r in result["rates"]), flush=True)
        finally:
            for d in daemons.values():
                await stop_daemon(d)
    return {"nproc": nproc, "steps": steps, "runs": runs, "unsettled": unsettled, "failed": failed,
            "sides": found, "blocks": per_block(found, blocks)}


def per_block(found: dict[str, list[dict[str, Any]]], blocks: int) -> list[dict[str, Any]]:
    rows = []
    for b in range(blocks):
        row: dict[str, Any] = {"block": b + 1}
        for side, results in found.items():
            row[f"{side}_rate"] = statistics.median(r["rates"][b] for r in results) if results else None
            row[f"{side}_faults"] = statistics.median(r["faults"][b] for r in results) if results else None
        pairs = list(zip(found["forked"], found["cold"], strict=False))
        ratios = [f["rates"][b] / c["rates"][b] for f, c in pairs]
        row["ratio"] = statistics.median(ratios) if ratios else None
        row["ratio_range"] = (min(ratios), max(ratios)) if ratios else None
        rows.append(row)
    return rows


def describe(result: dict[str, Any]) -> str:
    lines = [f"forked ramp: {result['nproc']} rank(s), blocks of {result['steps']} steps after {WARMUP} warm-up, "
             f"{result['runs']} runs a side ({result['unsettled']} measured unsettled)",
             "block  forked steps/s  faults   cold steps/s  faults   forked/cold median [range]"]
    for row in result["blocks"]:
        if row["ratio"] is None:
            continue
        lo, hi = row["ratio_range"]
        lines.append(f"{row['block']:>5}  {row['forked_rate']:>14.0f}  {row['forked_faults']:>6.0f}   "
                     f"{row['cold_rate']:>12.0f}  {row['cold_faults']:>6.0f}   {row['ratio']:.3f} [{lo:.3f}-{hi:.3f}]")
    for side, reasons in result["failed"].items():
        for reason in reasons:
            lines.append(f"FAILED {side}: {reason}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.forked_ramp", description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=6, help="jobs per side")
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--steps", type=int, default=2000, help="steps per block")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args()
    result = anyio.run(ramp, args.runs, args.nproc, args.blocks, args.steps)
    print(describe(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
