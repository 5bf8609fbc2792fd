"""A torchrun script for the multi-node view tests: each rank joins the world, writes known lines to
stdout and stderr, holds at a gate, then all-reduces and writes the sum.

``out rank R of W group_rank G`` and ``rank R waiting for gate`` (stdout), ``err rank R`` (stderr);
then it waits for the file argv[1] (the test's handshake: it decides when the ranks go on), and
writes ``rank R sum S`` (S: the sum of RANK + 1 over the world).
"""

import os
import sys
import time

import torch
import torch.distributed as dist

GATE_LIMIT = 300.0  # a forgotten gate must not keep a rank forever


def wait_for(path: str) -> None:
    deadline = time.monotonic() + GATE_LIMIT
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            sys.exit(f"{path} never appeared")
        time.sleep(0.02)


rank = int(os.environ["RANK"])
dist.init_process_group("gloo")
print(f"out rank {rank} of {dist.get_world_size()} group_rank {os.environ['GROUP_RANK']}", flush=True)
print(f"err rank {rank}", file=sys.stderr, flush=True)
print(f"rank {rank} waiting for gate", flush=True)
wait_for(sys.argv[1])
total = torch.tensor([float(rank + 1)])
dist.all_reduce(total)
print(f"rank {rank} sum {int(total.item())}", flush=True)
dist.destroy_process_group()
