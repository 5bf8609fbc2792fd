"""A script that leaves work for Python's exit: an atexit handler that writes a file, a non-daemon
"uploader" thread started at the end, a CSV written through a module-level open() never closed,
a MemoryHandler whose buffered records are never flushed by the script, and a gzip file never
closed. Every file is complete under `python` and torchrun. Usage: exit_work.py OUTDIR"""

from __future__ import annotations

import atexit
import gzip
import logging
import logging.handlers
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

out = sys.argv[1]
dist.init_process_group("gloo")
rank = dist.get_rank()
csv = open(os.path.join(out, f"losses-{rank}.csv"), "w")  # noqa: SIM115 (never closed: the point)
csv.write("step,loss\n")
zipped = gzip.open(os.path.join(out, f"log-{rank}.gz"), "wt")  # noqa: SIM115
target = logging.FileHandler(os.path.join(out, f"memory-{rank}.log"))
log = logging.getLogger("exit_work")
log.addHandler(logging.handlers.MemoryHandler(capacity=1000, flushLevel=logging.CRITICAL, target=target))
log.setLevel(logging.INFO)
torch.manual_seed(rank)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(100):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    csv.write(f"{step},{loss.item():.6f}\n")
    zipped.write(f"step {step}\n")
    if step % 2 == 0:
        log.info("step %d", step)


def at_exit() -> None:
    with open(os.path.join(out, f"atexit-{rank}.txt"), "w") as f:
        f.write("atexit ran\n")


atexit.register(at_exit)


def upload() -> None:
    time.sleep(1.0)
    with open(os.path.join(out, f"uploaded-{rank}.txt"), "w") as f:
        f.write("uploaded\n")


threading.Thread(target=upload).start()
print(f"exit_work rank {rank} done", flush=True)
