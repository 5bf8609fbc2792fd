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
    p.add_argument("--json", type=Path, help="also write the results here")
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
    clock = Clock(args.stamps, rank, args.warmup, args.steps, cuda)
    for step in range(1, args.steps + 1):
        clock.at_step(step)
        optimizer.zero_grad(set_to_none=True)
        mse(ddp(x), y).backward()
        optimizer.step()
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
    # a session of its own, as the daemon's ranks have (with autogroup scheduling, a session is a CPU share)
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False,
                          start_new_session=True)
    if done.returncode != 0:
        raise RuntimeError(f"torchrun exited with {done.returncode}:\n{done.stderr[-3000:]}")
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


async def bench_loop(ctx: Any) -> None:
    """The suite's entry (``BENCHES["loop"]``): the default comparison, recorded per launcher."""
    from benchmarks.common import DDPD, TORCHRUN_NAME

    result = await compare(parse_args([]))
    metric = ctx.results.metric("loop.steps", "loop", f"loop steps/s ({result['model']}, 2 ranks, CPU)", "steps/s",
                                higher_is_better=True)
    for row in result["rounds"]:
        metric.add(DDPD, row["ddpd"])
        metric.add(TORCHRUN_NAME, row["torchrun"])
    metric.notes.append(summary(result))


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

    result = anyio.run(compare, args)
    print(summary(result), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    if __package__ in (None, ""):  # run by path (torchrun): make `benchmarks` and `ddpd` importable
        sys.path[:0] = [str(REPO), str(REPO / "src")]
    sys.exit(main())
