"""A torchrun script that prints its whole environment as one JSON line, joins the group and checks it.

With ``--steps N`` it reports N steps through the optional ``ddpd.worker.api`` (a no-op under
torchrun); with ``--exit-code C`` it ends with that exit status after the group is destroyed.
"""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=0)
parser.add_argument("--exit-code", type=int, default=0)
args = parser.parse_args()

print("ddpd-test-env " + json.dumps({"env": dict(os.environ), "argv": sys.argv, "cwd": os.getcwd()}), flush=True)
dist.init_process_group("gloo")
total = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(total)
world = dist.get_world_size()
assert total.item() == world * (world + 1) / 2, total
try:
    from ddpd.worker import api
except ImportError:
    api = None
for step in range(1, args.steps + 1):
    if api is not None:
        api.report(step, loss=1.0 / step)
print(f"rank {dist.get_rank()} of {world} ok", flush=True)
dist.destroy_process_group()
sys.exit(args.exit_code)
