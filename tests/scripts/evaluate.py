"""An evaluation script as users write it (no ddpd import): collectives, but no optimizer.

    torchrun --standalone --nproc_per_node=2 evaluate.py --batches 200

It never steps an optimizer and never reports, so ddpd has no step counter for it: its
progress timeout does not apply, however long the evaluation takes.
"""

import argparse

import torch
import torch.distributed as dist
from torch import nn


def evaluate(model, batches):
    total = torch.zeros(1)
    with torch.no_grad():
        for _ in range(batches):
            total += model(torch.randn(64, 10)).sum()
            dist.all_reduce(total)
    return float(total)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, default=200)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    print(f"rank {dist.get_rank()} evaluated {evaluate(nn.Linear(10, 1), args.batches):.3f}", flush=True)
    dist.destroy_process_group()
