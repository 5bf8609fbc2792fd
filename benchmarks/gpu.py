"""GPU benchmark: the ``mlp`` task's steps per second under ddpd against the same loop under torchrun.

    python -m benchmarks.gpu                     # 3 rounds, one rank on GPU 0
    python -m benchmarks.gpu --nproc 2 --json out.json
    python -m benchmarks.gpu --min-ratio 0.95    # exit 1 when ddpd's median falls below 0.95x torchrun's

The model is ddpd's built-in ``mlp`` (4 x Linear(1024) + ReLU, batch 64, MSE, SGD) with NCCL; the
rounds, clocks and ratio are those of `benchmarks.loop` (see there), on the same GPU(s), one
after the other. It also lists the GPUs as the daemon's discovery (NVML) sees them. Exits 2,
saying why, where there is no CUDA device; 1 where the median ratio to torchrun is below
``--min-ratio`` (0.95, the check's bar; 0 turns it off).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ddpd.daemon.gpu import gpus

from . import loop


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu")
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--warmup", type=int, default=150)
    p.add_argument("--json", type=Path)
    p.add_argument("--min-ratio", type=float, default=0.95, help="fail below this median ddpd/torchrun ratio")
    args = p.parse_args(argv)
    try:
        found = gpus.discover()
    except RuntimeError as exc:
        found = []
        print(f"gpu discovery failed: {exc}", flush=True)
    for g in found:
        print(f"GPU {g.label} {g.uuid}: {g.name} memory {mib(g.memory_used)}/{mib(g.memory_total)} MiB "
              f"utilisation {g.utilization}% ({g.source})", flush=True)
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device here: the GPU benchmark did not run", flush=True)
        return 2
    if torch.cuda.device_count() < args.nproc:
        print(f"needs {args.nproc} GPUs, found {torch.cuda.device_count()}", flush=True)
        return 2
    import anyio

    bench = loop.parse_args(["--device", "cuda", "--nproc", str(args.nproc), "--layers", "4", "--width", "1024",
                             "--batch", "64", "--steps", str(args.steps), "--warmup", str(args.warmup),
                             "--rounds", str(args.rounds)])
    result = anyio.run(loop.compare, bench)
    print(loop.summary(result), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"gpus": [g.__dict__ for g in found], "mlp": result}, indent=2))
    if result["failed"]:  # a side that failed is a failed check, whichever side it was
        print(f"FAILED: {len(result['failed'])} run(s) failed: {result['failed']}", flush=True)
        return 1
    if result["ratio_median"] < args.min_ratio:
        print(f"FAILED: ddpd's median steps/s are {result['ratio_median']:.3f}x torchrun's, below {args.min_ratio:g}",
              flush=True)
        return 1
    print(f"PASSED: ddpd's median steps/s are {result['ratio_median']:.3f}x torchrun's (bar {args.min_ratio:g})",
          flush=True)
    return 0


def mib(value: int | None) -> str:
    return "?" if value is None else str(value >> 20)


if __name__ == "__main__":
    sys.exit(main())
