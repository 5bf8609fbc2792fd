"""``python -m benchmarks.pool [--rounds N] [--json PATH]``: the warm pool with its default size.

One daemon with the default pool config (no ``pool_size`` given), the jobs submitted as ``ddpctl
submit`` sends them (this interpreter, this shell's whole environment), so they use the pool of
their (user, interpreter, environment) key, which the pool learns from the first job:

- **back to back**: each round submits the classic two-layer job as a task (2 ranks, 20 steps)
  and then the same program as an unmodified torchrun script; each is timed from submit to
  SUCCEEDED and counted as warm when all its ranks were pooled.
- **torchrun** and **mp.spawn** run the same classic program in the same rounds, for the ratios.

Every side is treated alike: before each timed run (ddpd's task, ddpd's script, torchrun,
mp.spawn) the driver waits for the daemon's pool to be idle (refilled, nothing starting) and the
machine to be quiet (benchmarks/settle.py), so no side runs during another's refill; a run that
never got a quiet machine is counted as unsettled. Round 1 of every side is reported apart (its
jobs find the pool filling: the daemon's own key is learned at its start, another key from its
first job; torchrun's and mp.spawn's first run have a cold page cache), and the ratios use the
later rounds of each side. A ddpd job after round 1 that found no warm interpreter is kept in its
own series (``... (not warm)``), not dropped; a failed run of any side is counted with why.
- **memory**: the resident (VmRSS) and proportional (Pss, shared pages split) memory of each
  pooled interpreter that is ready, once the rounds are over.

Prints medians and ranges and writes them as JSON with ``--json``.
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

from ddpd.protocol import JobSpec

from .common import (
    DDP_SCRIPT,
    FINAL,
    SPAWN,
    TORCHRUN_NAME,
    BenchError,
    Daemon,
    rss_mib,
    start_daemon,
    state_is,
    stop_daemon,
    why,
)
from .launchers import start_launcher
from .settle import settle

STEPS = 20


def as_ddpctl(**fields: Any) -> JobSpec:
    return JobSpec(nproc=2, python=sys.executable, environ=dict(os.environ), export="ALL", **fields)


async def timed_job(d: Daemon, spec: JobSpec) -> tuple[float, bool]:
    t0 = time.perf_counter()
    job_id = await d.client.submit(spec)
    t_done, done = await d.events.wait(job_id, state_is(*FINAL))
    if done.data.get("to") != "SUCCEEDED":
        view = await d.client.status(job_id)
        raise BenchError(f"job {job_id} ended {view.state}: {why(view.root_cause)}\n{d.log_tail()}")
    pooled = [e.data.get("pooled") for _, e in d.events.by_job[job_id] if e.kind == "rank.spawned"]
    return t_done - t0, bool(pooled) and all(pooled)


async def timed_launcher(base: Path, kind: str) -> float:
    run = await start_launcher(kind, base, ["--task", "two-layer", "--steps", str(STEPS)])
    try:
        rc = await run.proc.wait()
        if rc != 0:
            raise BenchError(f"{kind} exited with {rc}:\n{run.log_tail()}")
        return time.perf_counter() - run.t0
    finally:
        run.kill()


def pool_pids(d: Daemon) -> list[int]:
    ready: set[int] = set()
    for line in d.log_path.read_text(errors="replace").splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if e.get("event") == "pool.worker_ready":
            ready.add(int(e["pid"]))
        elif e.get("event") in ("pool.worker_taken", "pool.worker_died", "pool.worker_retired"):
            ready.discard(int(e["pid"]))
    return sorted(p for p in ready if Path(f"/proc/{p}").exists())


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


SIDES = ("task", "script", TORCHRUN_NAME, SPAWN)


async def timed_side(d: Daemon, base: Path, name: str, n: int) -> tuple[float, bool | None]:
    """One timed run of side `name` in round `n`: seconds, and for ddpd whether it was warm."""
    if name == "task":
        return await timed_job(d, as_ddpctl(task="two-layer", steps=STEPS))
    if name == "script":
        return await timed_job(d, as_ddpctl(script=[DDP_SCRIPT, "--task", "two-layer", "--steps", str(STEPS),
                                                    "--stamps", str(base / f"s{n}")]))
    return await timed_launcher(base, name), None


def series(name: str, n: int, warm: bool | None) -> str:
    """The series a run goes to: round 1 apart for every side, a ddpd job that found no warm
    interpreter apart from the warm ones."""
    if n == 0:
        return f"{name} (round 1)"
    if warm is None:
        return name
    return f"{name} ({'warm' if warm else 'not warm'})"


async def measure(rounds: int) -> dict[str, Any]:
    times: dict[str, list[float]] = {}
    failed: dict[str, list[str]] = {}
    unsettled: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="ddpd-pool-") as tmp:
        base = Path(tmp)
        d = await start_daemon(base, "pool")
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(d.follow_events)
                for n in range(rounds):
                    for name in SIDES:
                        settled = await settle([d])  # the same wait before every side
                        if not settled.quiet:
                            unsettled[name] = unsettled.get(name, 0) + 1
                        try:
                            seconds, warm = await timed_side(d, base, name, n)
                        except BenchError as exc:
                            failed.setdefault(name, []).append(f"round {n + 1}: {exc}")
                            print(f"round {n + 1} {name:8} FAILED: {exc}", flush=True)
                            continue
                        times.setdefault(series(name, n, warm), []).append(seconds)
                        state = "" if warm is None else "warm" if warm else "not warm"
                        print(f"round {n + 1} {name:8} {seconds:.3f}s {state} ({settled.text()})", flush=True)
                pids = pool_pids(d)
                memory = {"pids": len(pids), "rss_mib": [round(rss_mib(p), 1) for p in pids],
                          "pss_mib": [round(_pss_mib(p), 1) for p in pids]}
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await stop_daemon(d)
    result: dict[str, Any] = {k: summary(v) for k, v in times.items()}
    result["not_warm_after_first"] = sum(len(v) for k, v in times.items() if k.endswith("(not warm)"))
    result["failed"] = failed
    result["unsettled"] = unsettled
    result["memory"] = memory
    for name in ("task (warm)", "script (warm)"):  # rounds 2.. of each side alike
        for reference in (TORCHRUN_NAME, SPAWN):
            if name in result and reference in result:
                result[f"{name} / {reference}"] = result[name]["median"] / result[reference]["median"]
    return result


def _pss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) / 1024
    return 0.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.pool", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    result = anyio.run(measure, args.rounds)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text)
    return 0 if result["not_warm_after_first"] == 0 and not result["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
