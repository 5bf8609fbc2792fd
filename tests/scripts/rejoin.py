"""A torchrun script that evaluates in a process group of its own first, as some evaluation
loops do (no ddpd import): ROUNDS times init_process_group, an all_reduce, destroy_process_group;
then it joins once more and trains STEPS optimizer steps of a small DDP model.

    torchrun --standalone --nproc_per_node=2 rejoin.py --rounds 2 --steps 5
"""

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def evaluate():
    dist.init_process_group("gloo")
    total = torch.ones(1)
    dist.all_reduce(total)
    assert total.item() == dist.get_world_size()
    dist.destroy_process_group()


def train(steps):
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(nn.Linear(10, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(8, 10)).pow(2).mean().backward()
        optimizer.step()
    print(f"rank {dist.get_rank()} trained {steps} steps", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    for _ in range(args.rounds):
        evaluate()
    train(args.steps)
