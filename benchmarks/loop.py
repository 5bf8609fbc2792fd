"""The training loop's own cost: ddpd's built-in loop against the same bare loop under torchrun.

    python -m benchmarks.loop                      # tiny model on CPU: 2 x Linear(32), batch 8, 2 ranks
    python -m benchmarks.loop --rounds 5 --steps 5000
    python -m benchmarks.loop --device cuda --nproc 1 --layers 4 --width 1024 --batch 64   (the mlp task)

Each round runs the same model, data and optimizer three times, one after the other (the order
reverses between rounds): as ddpd's built-in ``mlp`` task on a fresh daemon, as a bare DDP loop
(this file with ``--bare``) under torchrun, and as that same bare loop, an unmodified script,
under the same daemon; one intra-op thread per rank everywhere, and torchrun in a session of its
own as the daemon's ranks are. All sides take their clock at the same points inside rank 0: at
the start of step ``warmup + 1`` and at the start of the last step (with a CUDA synchronisation
at both points on a GPU), so start-up, imports and the rendezvous are left out and only the
steady loop is timed. The bare loop reads no loss and sends nothing: the stricter reference.

The results are ddpd's steps per second over torchrun's and over the bare script's under ddpd
(the loop's own cost, the launcher being the same), per round, and their medians with the range.
The target is >= 0.98. On a shared machine the figures are noisy: read the range.

**Back to back** (``--back-to-back``, and part of the suite's ``loop``): the way people submit, the
bare loop as an unmodified script, each job submitted when the previous one ended: to a
default-config daemon (warm pool on: each job takes pooled interpreters while the pool refills
behind it), to a daemon without a pool (cold), and the same file under torchrun, alternating.
Each side runs a short job, then at once a long one: under ddpd the short job emptied the pool,
which refills while the long one trains. Two rates per side: the long run's steps per second on
rank 0's clock from the short run's step count on (whatever runs beside the job, a refill, counts;
start-up does not), and the difference of the two runs' wall times (submit to SUCCEEDED;
torchrun's whole run) over the difference of their steps, which a loaded machine's start-up
noise swamps. On the tiny model (2 x Linear(32), batch 8) and on 4 x Linear(1024), batch 64.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.loop")
    p.add_argument("--bare", action="store_true", help="run as one rank of the bare loop (under torchrun)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stamps", type=Path, help="(--bare) directory for rank 0's clock")
    p.add_argument("--gate", type=Path, help="(--bare) the paired benchmark's FIFO gates (benchmarks/gate.py)")
    p.add_argument("--segment", type=int, default=500, help="(--bare --gate) steps per gated segment")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--back-to-back", action="store_true", help="the back-to-back comparison (pooled, cold, torchrun)")
    return p.parse_args(argv)


class Clock:
    """Rank 0's clock at the start of step `warmup + 1` and of step `steps`; written to `stamps/clock.json`."""

    def __init__(self, stamps: Path, rank: int, warmup: int, steps: int, cuda: bool) -> None:
        self.path, self.rank, self.warmup, self.steps, self.cuda = stamps / "clock.json", rank, warmup, steps, cuda
        self.t0 = 0.0

    def at_step(self, step: int) -> None:
        if self.rank != 0 or step not in (self.warmup + 1, self.steps):
            return
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        now = time.perf_counter()
        if step == self.warmup + 1:
            self.t0 = now
            return
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"steps": self.steps - 1 - self.warmup, "seconds": now - self.t0}))
        os.replace(tmp, self.path)


def timed_mlp(ctx: Any) -> Any:
    """ddpd's built-in ``mlp`` task with rank 0's clock in its step hook (``options["stamps"]``)."""
    import dataclasses

    from ddpd.worker.tasks import mlp

    clock = Clock(Path(str(ctx.options["stamps"])), ctx.rank, int(ctx.options["warmup"]), ctx.steps,
                  ctx.device.type == "cuda")
    return dataclasses.replace(mlp(ctx), on_step=clock.at_step)


def bare(args: argparse.Namespace) -> None:
    """One rank of the bare loop: what ddpd's ``mlp`` task does, written as a torchrun script would."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    cuda = args.device == "cuda"
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    torch.manual_seed(args.seed)
    blocks: list[nn.Module] = []
    for _ in range(args.layers):
        blocks += [nn.Linear(args.width, args.width), nn.ReLU()]
    model = nn.Sequential(*blocks).to(device)
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank + 1)
    x = torch.randn(args.batch, args.width, generator=gen).to(device)
    y = torch.randn(args.batch, args.width, generator=gen).to(device)
    ddp = DistributedDataParallel(model, device_ids=[device] if cuda else None)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    mse = nn.MSELoss()
    clock = Clock(args.stamps, rank, args.warmup, args.steps, cuda) if args.stamps else None

    def train() -> None:
        optimizer.zero_grad(set_to_none=True)
        mse(ddp(x), y).backward()
        optimizer.step()

    if args.gate:  # the paired benchmark: warm-up, then segments when the driver says
        from benchmarks.gate import Gate

        for _ in range(args.warmup):
            train()
        Gate(args.gate, rank, args.segment).run(args.steps - args.warmup, train)
    else:
        for step in range(1, args.steps + 1):
            if clock is not None:
                clock.at_step(step)
            train()
    dist.destroy_process_group()


def read_clock(stamps: Path) -> float:
    data = json.loads((stamps / "clock.json").read_text())
    return float(data["steps"]) / float(data["seconds"])


def bare_argv(args: argparse.Namespace, stamps: Path) -> list[str]:
    return ["--bare", "--stamps", str(stamps), "--device", args.device, "--layers", str(args.layers),
            "--width", str(args.width), "--batch", str(args.batch), "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--seed", str(args.seed)]


def run_torchrun(args: argparse.Namespace, stamps: Path) -> float:
    from benchmarks.common import TORCHRUN, free_port

    argv = [TORCHRUN, "--nproc-per-node", str(args.nproc), "--master-addr", "127.0.0.1", "--master-port",
            str(free_port()), str(Path(__file__)), *bare_argv(args, stamps)]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // args.nproc))}
    if args.device == "cuda":
        env.setdefault("CUDA_VISIBLE_DEVICES", ",".join(str(i) for i in range(args.nproc)))
    torchrun_once_more(argv, env)
    return read_clock(stamps)


async def run_ddpd(args: argparse.Namespace, daemon: Any, stamps: Path) -> float:
    import anyio

    from ddpd.protocol import JobSpec, JobState

    spec = JobSpec(name="bench-loop", task="benchmarks.loop:timed_mlp", nproc=args.nproc, steps=args.steps,
                   seed=args.seed, workdir=str(REPO), device=args.device,
                   options={"layers": args.layers, "width": args.width, "batch": args.batch,
                            "stamps": str(stamps), "warmup": args.warmup})
    job_id = await daemon.client.submit(spec)
    with anyio.fail_after(600):
        job = await daemon.client.wait(job_id)
    if job.state != JobState.SUCCEEDED:
        raise RuntimeError(f"ddpd job {job.state}: {job.reason} {job.root_cause}")
    return read_clock(stamps)


async def run_ddpd_script(args: argparse.Namespace, daemon: Any, stamps: Path) -> float:
    """The bare loop as an unmodified script under ddpd: the same launcher, none of the loop's work."""
    import anyio

    from ddpd.protocol import JobSpec, JobState

    spec = JobSpec(name="bench-loop-bare", script=[str(Path(__file__)), *bare_argv(args, stamps)], nproc=args.nproc,
                   workdir=str(REPO), device=args.device)
    job_id = await daemon.client.submit(spec)
    with anyio.fail_after(600):
        job = await daemon.client.wait(job_id)
    if job.state != JobState.SUCCEEDED:
        raise RuntimeError(f"ddpd script job {job.state}: {job.reason} {job.root_cause}")
    return read_clock(stamps)


async def compare(args: argparse.Namespace) -> dict[str, Any]:
    """`args.rounds` side-by-side rounds; the steps per second of each side and their ratios."""
    from benchmarks.common import start_daemon, stop_daemon

    rows: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="ddpd-loop-") as tmp:
        base = Path(tmp)
        daemon = await start_daemon(base, "loop", config={"cpu_slots": max(args.nproc, os.cpu_count() or 1),
                                                              "pool_size": 0})
        try:
            for n in range(args.rounds):
                rates: dict[str, float] = {}
                order = ("ddpd", "torchrun", "ddpd-script")
                for side in order if n % 2 == 0 else order[::-1]:
                    stamps = base / f"{side}-{n}"
                    stamps.mkdir()
                    if side == "ddpd":
                        rates[side] = await run_ddpd(args, daemon, stamps)
                    elif side == "ddpd-script":
                        rates[side] = await run_ddpd_script(args, daemon, stamps)
                    else:
                        rates[side] = run_torchrun(args, stamps)
                row = {**rates, "ratio": rates["ddpd"] / rates["torchrun"],
                       "loop_ratio": rates["ddpd"] / rates["ddpd-script"]}
                rows.append(row)
                print(f"round {n + 1}: ddpd {row['ddpd']:.0f} steps/s, torchrun {row['torchrun']:.0f}, bare script "
                      f"under ddpd {row['ddpd-script']:.0f}; ratio to torchrun {row['ratio']:.3f}, to the bare "
                      f"script {row['loop_ratio']:.3f}", flush=True)
        finally:
            await stop_daemon(daemon)
    ratios = [r["ratio"] for r in rows]
    loops = [r["loop_ratio"] for r in rows]
    return {"loop_ratio_median": statistics.median(loops), "loop_ratio_min": min(loops),
            "loop_ratio_max": max(loops), "model": f"{args.layers} x Linear({args.width}), batch {args.batch}",
            "device": args.device,
            "nproc": args.nproc, "steps": args.steps, "warmup": args.warmup, "rounds": rows,
            "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}


# -- back to back: short and long runs, pooled, cold and torchrun, alternating ----------------------

# (label, layers, width, batch, short steps, long steps)
MODELS = (("tiny", 2, 32, 8, 200, 4200), ("4x1024", 4, 1024, 64, 20, 220))
B2B_SIDES = ("pooled", "cold", "torchrun")


def b2b_argv(layers: int, width: int, batch: int, steps: int, warmup: int, stamps: Path) -> list[str]:
    return ["--bare", "--layers", str(layers), "--width", str(width), "--batch", str(batch), "--steps", str(steps),
            "--warmup", str(warmup), "--stamps", str(stamps)]


async def b2b_job(daemon: Any, argv: list[str], nproc: int) -> float:
    """Seconds from submit to SUCCEEDED of the bare loop as a script job."""
    import anyio

    from ddpd.protocol import JobSpec, JobState

    started = time.perf_counter()
    job_id = await daemon.client.submit(JobSpec(name="bench-b2b", script=[str(Path(__file__)), *argv], nproc=nproc,
                                                workdir=str(REPO)))
    with anyio.fail_after(600):
        job = await daemon.client.wait(job_id)
    if job.state != JobState.SUCCEEDED:
        raise RuntimeError(f"ddpd script job {job.state}: {job.reason} {job.root_cause}")
    return time.perf_counter() - started


def b2b_torchrun(argv: list[str], nproc: int) -> float:
    """Seconds of a whole torchrun of the bare loop (its launch included, as a job's is)."""
    from benchmarks.common import TORCHRUN, free_port

    started = time.perf_counter()
    full = [TORCHRUN, "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port",
            str(free_port()), str(Path(__file__)), *argv]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc))}
    torchrun_once_more(full, env)
    return time.perf_counter() - started


def torchrun_once_more(argv: list[str], env: dict[str, str]) -> None:
    """Run torchrun; a run that fails is said and run again once (its gloo mesh sometimes times out
    connecting on a loaded machine: torchrun's failure, not a measurement), a second failure raises."""
    for attempt in (1, 2):
        done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False,
                              start_new_session=True)
        if done.returncode == 0:
            return
        last = done.stderr.strip().splitlines()[-1:] or [""]
        print(f"  torchrun exited with {done.returncode} (run {attempt} of 2): {last[0][:200]}", flush=True)
    raise RuntimeError(f"torchrun exited with {done.returncode} twice:\n{done.stderr[-3000:]}")


POOL_SETTLE = 120.0  # seconds the pooled daemon's refill may take before a side starts


async def pool_settled(daemon: Any, size: int = 2) -> None:
    """Wait until the pooled daemon's warm pool holds `size` ready interpreters again and refills none
    (it may keep more than `size`, one set per kind of job it saw): a refill after
    the pooled side's jobs would otherwise run (at normal priority: that daemon has no job) during the
    next side, which is then measured on a busy machine."""
    import anyio

    with anyio.fail_after(POOL_SETTLE):
        while True:  # the daemon says nothing when its pool fills: asked five times a second
            info = await daemon.client.daemon_info()
            if (info.pool_ready or 0) >= size and "refilling" not in (info.pool_state or ""):
                return
            await anyio.sleep(0.2)


async def b2b_rate(side: str, daemons: dict[str, Any], model: tuple[str, int, int, int, int, int],
                   nproc: int, stamps: Path) -> tuple[float, float]:
    """One side, a short then a long run back to back: the long run's steps/s on rank 0's clock (from
    step `short` on), and (long - short) steps over the difference of their wall times."""
    _, layers, width, batch, short, long = model
    await pool_settled(daemons["pooled"])  # every side starts on a quiet machine (no refill of an earlier side)
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
    return read_clock(stamps / f"{side}-{long}"), wall


async def back_to_back(rounds: int, nproc: int = 2) -> dict[str, Any]:
    """`rounds` alternating rounds per model; each side's steps/s and ddpd's ratios to torchrun."""
    from benchmarks.common import start_daemon, stop_daemon

    slots = max(nproc, os.cpu_count() or 1)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="ddpd-b2b-") as tmp:
        base = Path(tmp)
        daemons = {"pooled": await start_daemon(base, "pooled", config={"cpu_slots": slots}),
                   "cold": await start_daemon(base, "cold", config={"cpu_slots": slots, "pool_size": 0})}
        try:
            for model in MODELS:
                rows = []
                for n in range(rounds):
                    rates = {side: await b2b_rate(side, daemons, model, nproc, base / f"{model[0]}-{n}")
                             for side in (B2B_SIDES if n % 2 == 0 else B2B_SIDES[::-1])}
                    row = {side: clock for side, (clock, _) in rates.items()}
                    row.update({f"{side}_wall": wall for side, (_, wall) in rates.items()})
                    rows.append({**row, "pooled_ratio": row["pooled"] / row["torchrun"],
                                 "cold_ratio": row["cold"] / row["torchrun"],
                                 "pooled_wall_ratio": row["pooled_wall"] / row["torchrun_wall"]})
                    print(f"{model[0]} round {n + 1}: pooled {row['pooled']:.1f} steps/s, cold {row['cold']:.1f}, "
                          f"torchrun {row['torchrun']:.1f}; ratios {rows[-1]['pooled_ratio']:.3f} (pooled), "
                          f"{rows[-1]['cold_ratio']:.3f} (cold); from wall times {rows[-1]['pooled_wall_ratio']:.3f} "
                          f"(pooled)", flush=True)
                results[model[0]] = rows
        finally:
            for d in daemons.values():
                await stop_daemon(d)
    return results


def spread(rows: list[dict[str, float]], key: str) -> str:
    values = [r[key] for r in rows]
    return f"{statistics.median(values):.3f}x [{min(values):.3f}-{max(values):.3f}]"


def b2b_summary(results: dict[str, Any]) -> str:
    return "; ".join(f"back to back, {label}: ddpd/torchrun steps/s pooled {spread(rows, 'pooled_ratio')}, cold "
                     f"{spread(rows, 'cold_ratio')} over {len(rows)} rounds (target >= 0.98); from wall-time "
                     f"differences, pooled {spread(rows, 'pooled_wall_ratio')}" for label, rows in results.items())


async def bench_loop(ctx: Any) -> None:
    """The suite's entry (``BENCHES["loop"]``): the default comparison, recorded per launcher, then the
    back-to-back one (``loop.b2b.<model>``: pooled as ddpd, cold as ddpd (cold), and torchrun)."""
    from benchmarks.common import DDPD, DDPD_COLD, TORCHRUN_NAME

    result = await compare(parse_args(["--rounds", "2"] if ctx.plan.short else []))
    metric = ctx.results.metric("loop.steps", "loop", f"loop steps/s ({result['model']}, 2 ranks, CPU)", "steps/s",
                                higher_is_better=True)
    for row in result["rounds"]:
        metric.add(DDPD, row["ddpd"])
        metric.add(TORCHRUN_NAME, row["torchrun"])
    metric.notes.append(summary(result))
    b2b = await back_to_back(3 if ctx.plan.short else 5)
    for label, rows in b2b.items():
        m = ctx.results.metric(f"loop.b2b.{label}", "loop", f"back-to-back steps/s ({label}, 2 ranks, CPU)",
                               "steps/s", higher_is_better=True)
        for row in rows:
            m.add(DDPD, row["pooled"])
            m.add(DDPD_COLD, row["cold"])
            m.add(TORCHRUN_NAME, row["torchrun"])
        m.notes.append(b2b_summary({label: rows}))


def summary(result: dict[str, Any]) -> str:
    return (f"loop, {result['model']}, {result['nproc']} rank(s) on {result['device']}: ddpd/torchrun steps/s "
            f"{result['ratio_median']:.3f}x [{result['ratio_min']:.3f}-{result['ratio_max']:.3f}] over "
            f"{len(result['rounds'])} rounds (target >= 0.98); against the same bare loop as a script under "
            f"ddpd {result['loop_ratio_median']:.3f}x [{result['loop_ratio_min']:.3f}-{result['loop_ratio_max']:.3f}]")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.bare:
        bare(args)
        return 0
    import anyio

    if args.back_to_back:
        b2b = anyio.run(back_to_back, args.rounds, args.nproc)
        print(b2b_summary(b2b), flush=True)
        if args.json:
            args.json.write_text(json.dumps(b2b, indent=2))
        return 0
    result = anyio.run(compare, args)
    print(summary(result), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    if __package__ in (None, ""):  # run by path (torchrun): make `benchmarks` and `ddpd` importable
        sys.path[:0] = [str(REPO), str(REPO / "src")]
    sys.exit(main())
