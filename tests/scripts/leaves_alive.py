"""A DDP script that leaves its model, optimizer and process group to the end of the process, the way
many scripts do: every object that dies prints ``freed <name>`` to stderr from its finalizer.

``--end`` says how the script ends: ``destroy`` (destroy_process_group as the last line, the DDP
model still alive), ``exit`` (``sys.exit(0)`` mid-script) or ``leave`` (never destroys its group).
ddpd must free none of them before the rank leaves (the finalizers never print). DDP's objects sit
in reference cycles, freed whenever the collector happens to run (so the hang this guards against
came and went): the script makes the collector run at the first call after it returned (a profile
hook made outside its globals, which would otherwise keep them alive).
"""

from __future__ import annotations

import argparse
import sys
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

parser = argparse.ArgumentParser()
parser.add_argument("--end", choices=("destroy", "exit", "leave"), default="destroy")
parser.add_argument("--steps", type=int, default=3)
args = parser.parse_args()

dist.init_process_group("gloo")
model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(4, 8), torch.randn(4, 8)
canary = argparse.Namespace()
for name, thing in (("globals", canary), ("model", model), ("optimizer", optimizer), ("group", dist.group.WORLD)):
    # atexit False: only a real free prints (a finalizer is also called by weakref's atexit hook, which
    # the rank's exit work runs, as python's does, without freeing anything)
    weakref.finalize(thing, print, f"freed {name}", file=sys.stderr, flush=True).atexit = False
for _ in range(args.steps):
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
print(f"trained {args.steps} steps", flush=True)

COLLECT_AFTER_THE_SCRIPT = """
import gc, sys
returned = []
def hook(frame, event, arg):
    if event == "return" and frame.f_code.co_name in ("run_path", "run_module"):
        returned.append(True)
    elif event == "call" and returned:
        sys.setprofile(None)
        gc.collect()
"""
collector: dict[str, Any] = {}
exec(COLLECT_AFTER_THE_SCRIPT, collector)
sys.setprofile(collector["hook"])
if args.end == "exit":
    sys.exit(0)
if args.end == "destroy":
    dist.destroy_process_group()
