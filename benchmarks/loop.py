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

**Back to back** (``--back-to-back``, and part of the suite's ``loop``): the way people submit,
each job submitted when the previous one ended (benchmarks/back_to_back.py).

Every side is treated alike: before each side the machine is quiet (benchmarks/settle.py; a side
measured on a machine that never got quiet is counted as unsettled), no run is retried and none
dropped: a side that fails is counted as failed with why, and its round's ratios leave it out.
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
    from benchmarks.back_to_back import torchrun_once

    torchrun_once(argv, env)
    return read_clock(stamps)


async def run_ddpd(args: argparse.Namespace, daemon: Any, stamps: Path) -> float:
    import anyio

    from benchmarks.back_to_back import SideFailed
    from ddpd.protocol import JobSpec, JobState

    spec = JobSpec(name="bench-loop", task="benchmarks.loop:timed_mlp", nproc=args.nproc, steps=args.steps,
                   seed=args.seed, workdir=str(REPO), device=args.device,
                   options={"layers": args.layers, "width": args.width, "batch": args.batch,
                            "stamps": str(stamps), "warmup": args.warmup})
    job_id = await daemon.client.submit(spec)
    with anyio.fail_after(600):
        job = await daemon.client.wait(job_id)
    if job.state != JobState.SUCCEEDED:
        raise SideFailed(f"ddpd job {job_id} {job.state}: {job.reason} {job.root_cause}")
    return read_clock(stamps)


async def run_ddpd_script(args: argparse.Namespace, daemon: Any, stamps: Path) -> float:
    """The bare loop as an unmodified script under ddpd: the same launcher, none of the loop's work."""
    import anyio

    from benchmarks.back_to_back import SideFailed
    from ddpd.protocol import JobSpec, JobState

    spec = JobSpec(name="bench-loop-bare", script=[str(Path(__file__)), *bare_argv(args, stamps)], nproc=args.nproc,
                   workdir=str(REPO), device=args.device)
    job_id = await daemon.client.submit(spec)
    with anyio.fail_after(600):
        job = await daemon.client.wait(job_id)
    if job.state != JobState.SUCCEEDED:
        raise SideFailed(f"ddpd script job {job_id} {job.state}: {job.reason} {job.root_cause}")
    return read_clock(stamps)


async def compare(args: argparse.Namespace) -> dict[str, Any]:
    """`args.rounds` side-by-side rounds; the steps per second of each side and their ratios."""
    from benchmarks.back_to_back import SideFailed
    from benchmarks.common import start_daemon, stop_daemon
    from benchmarks.settle import settle

    rows: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []
    unsettled: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="ddpd-loop-") as tmp:
        base = Path(tmp)
        daemon = await start_daemon(base, "loop", config={"cpu_slots": max(args.nproc, os.cpu_count() or 1),
                                                              "pool_size": 0})
        try:
            for n in range(args.rounds):
                rates: dict[str, float | None] = {}
                order = ("ddpd", "torchrun", "ddpd-script")
                for side in order if n % 2 == 0 else order[::-1]:
                    stamps = base / f"{side}-{n}"
                    stamps.mkdir()
                    if not (await settle([daemon])).quiet:  # the same wait before every side
                        unsettled[side] = unsettled.get(side, 0) + 1
                    try:
                        rates[side] = await run_side(args, daemon, side, stamps)
                    except SideFailed as exc:
                        rates[side] = None
                        failed.append({"round": n + 1, "side": side, "why": str(exc)})
                        print(f"round {n + 1}: {side} FAILED: {exc}", flush=True)
                row = {**rates, "ratio": _over(rates["ddpd"], rates["torchrun"]),
                       "loop_ratio": _over(rates["ddpd"], rates["ddpd-script"])}
                rows.append(row)
                print(f"round {n + 1}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items() if v is not None),
                      flush=True)
        finally:
            await stop_daemon(daemon)
    ratios = [r["ratio"] for r in rows if r["ratio"] is not None] or [float("nan")]
    loops = [r["loop_ratio"] for r in rows if r["loop_ratio"] is not None] or [float("nan")]
    return {"loop_ratio_median": statistics.median(loops), "loop_ratio_min": min(loops),
            "loop_ratio_max": max(loops), "model": f"{args.layers} x Linear({args.width}), batch {args.batch}",
            "device": args.device, "failed": failed, "unsettled": unsettled,
            "nproc": args.nproc, "steps": args.steps, "warmup": args.warmup, "rounds": rows,
            "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}


def _over(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b is not None else None


async def run_side(args: argparse.Namespace, daemon: Any, side: str, stamps: Path) -> float:
    if side == "ddpd":
        return await run_ddpd(args, daemon, stamps)
    if side == "ddpd-script":
        return await run_ddpd_script(args, daemon, stamps)
    return run_torchrun(args, stamps)


async def bench_loop(ctx: Any) -> None:
    """The suite's entry (``BENCHES["loop"]``): the default comparison, recorded per launcher, then the
    back-to-back one (``loop.b2b.<model>``: pooled as ddpd, cold as ddpd (cold), and torchrun)."""
    from benchmarks.back_to_back import b2b_summary, back_to_back
    from benchmarks.common import DDPD, DDPD_COLD, TORCHRUN_NAME

    result = await compare(parse_args(["--rounds", "2"] if ctx.plan.short else []))
    metric = ctx.results.metric("loop.steps", "loop", f"loop steps/s ({result['model']}, 2 ranks, CPU)", "steps/s",
                                higher_is_better=True)
    for row in result["rounds"]:
        for side, launcher in (("ddpd", DDPD), ("torchrun", TORCHRUN_NAME)):
            if row.get(side) is not None:
                metric.add(launcher, row[side])
    for failure in result["failed"]:
        if failure["side"] != "ddpd-script":  # the series kept here: ddpd's task and torchrun
            metric.fail(TORCHRUN_NAME if failure["side"] == "torchrun" else DDPD,
                        f"round {failure['round']}: {failure['why']}")
    metric.notes.append(summary(result))
    b2b = await back_to_back(3 if ctx.plan.short else 5)
    for label, rows in b2b["models"].items():
        m = ctx.results.metric(f"loop.b2b.{label}", "loop", f"back-to-back steps/s ({label}, 2 ranks, CPU)",
                               "steps/s", higher_is_better=True)
        for row in rows:
            for side, launcher in (("pooled", DDPD), ("cold", DDPD_COLD), ("torchrun", TORCHRUN_NAME)):
                if row.get(side) is not None:
                    m.add(launcher, row[side])
        for failure in b2b["failed"]:
            if failure["model"] == label:
                side = {"pooled": DDPD, "cold": DDPD_COLD}.get(failure["side"], TORCHRUN_NAME)
                m.fail(side, f"round {failure['round']}: {failure['why']}")
        for side, count in b2b["unsettled"].items():
            m.unsettled[{"pooled": DDPD, "cold": DDPD_COLD}.get(side, TORCHRUN_NAME)] = count
        m.notes.append(b2b_summary({**b2b, "models": {label: rows}}))


def summary(result: dict[str, Any]) -> str:
    text = (f"loop, {result['model']}, {result['nproc']} rank(s) on {result['device']}: ddpd/torchrun steps/s "
            f"{result['ratio_median']:.3f}x [{result['ratio_min']:.3f}-{result['ratio_max']:.3f}] over "
            f"{len(result['rounds'])} rounds (target >= 0.98); against the same bare loop as a script under "
            f"ddpd {result['loop_ratio_median']:.3f}x [{result['loop_ratio_min']:.3f}-{result['loop_ratio_max']:.3f}]")
    lines = [text] + [f"  FAILED round {f['round']} {f['side']}: {f['why']}" for f in result["failed"]]
    if result["unsettled"]:
        lines.append(f"  measured on a machine that never got quiet: {result['unsettled']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.bare:
        bare(args)
        return 0
    import anyio

    if args.back_to_back:
        from benchmarks.back_to_back import b2b_summary, back_to_back

        b2b = anyio.run(back_to_back, args.rounds, args.nproc)
        print(b2b_summary(b2b), flush=True)
        if args.json:
            args.json.write_text(json.dumps(b2b, indent=2))
        return 1 if b2b["failed"] else 0
    result = anyio.run(compare, args)
    print(summary(result), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    if __package__ in (None, ""):  # run by path (torchrun): make `benchmarks` and `ddpd` importable
        sys.path[:0] = [str(REPO), str(REPO / "src")]
    sys.exit(main())
