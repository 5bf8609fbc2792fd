"""An evaluation script as users write it (no ddpd import): collectives, but no optimizer.

    torchrun --standalone --nproc_per_node=2 evaluate.py --seconds 3

It never steps an optimizer and never reports, so ddpd has no step counter for it: its
progress timeout does not apply, however long the evaluation takes.
"""

import argparse
import time

import torch
import torch.distributed as dist
from torch import nn


def evaluate(model, seconds):
    """Batches until `seconds` have passed on any rank (the ranks agree, so all stop together)."""
    total, start = torch.zeros(1), time.monotonic()
    with torch.no_grad():
        while True:
            total += model(torch.randn(64, 10)).sum()
            dist.all_reduce(total)
            done = torch.tensor([float(time.monotonic() - start > seconds)])
            dist.all_reduce(done, op=dist.ReduceOp.MAX)
            if done.item():
                return float(total)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    print(f"rank {dist.get_rank()} evaluated {evaluate(nn.Linear(10, 1), args.seconds):.3f}", flush=True)
    dist.destroy_process_group()
