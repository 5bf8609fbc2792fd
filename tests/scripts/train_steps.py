"""A torchrun training script as users write it (no ddpd import): it trains, and can misbehave.

    torchrun --standalone --nproc_per_node=2 train_steps.py --steps 20 [--hang-rank 1] [--gate PATH]

- ``--steps N``: N optimizer steps of a small DDP model (CPU, gloo), then a clean exit;
- ``--hang-rank R``: after N steps, rank R reduces a metric in a collective that no other rank
  makes (the classic "log only on one rank" bug), before its optimizer step: it hangs there,
  one step behind, while its peers wait for it in DDP's gradient all-reduce;
- ``--gate PATH``: after N steps every rank waits in `wait_at_gate` until PATH exists.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

GATE_LIMIT = 300.0  # a forgotten gate must not keep a rank forever


def log_metric(loss, group):
    value = loss.detach().clone()
    dist.all_reduce(value, group=group)  # the hang: no other rank joins this all_reduce
    return float(value)


def wait_at_gate(path):
    print(f"rank {dist.get_rank()} waiting at the gate", flush=True)
    deadline = time.monotonic() + GATE_LIMIT
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise SystemExit("gate never opened")
        time.sleep(0.05)


def main(args):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    metrics = dist.new_group(list(range(dist.get_world_size())))
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    inputs = torch.randn(8, 10)
    taken = 0
    limit = args.steps * 1000 if args.hang_rank is not None else args.steps
    for step in range(1, limit + 1):
        optimizer.zero_grad()
        loss = model(inputs).pow(2).mean()
        loss.backward()
        if step > args.steps and rank == args.hang_rank:
            log_metric(loss, metrics)
        optimizer.step()
        taken += 1
    print(f"rank {rank} took {taken} optimizer steps", flush=True)
    if args.gate:
        wait_at_gate(args.gate)
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--hang-rank", type=int, default=None)
    parser.add_argument("--gate", default=None)
    main(parser.parse_args())
