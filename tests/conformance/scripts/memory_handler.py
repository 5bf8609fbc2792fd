"""A ``logging.handlers.MemoryHandler`` in front of a file: 50 records buffered (capacity 1000, flushed
only at CRITICAL) and never flushed by the script; ``logging.shutdown``, run at interpreter exit,
flushes them into ``out/log-rank{R}.txt``.

    torchrun --nproc-per-node 2 memory_handler.py
"""

import logging
import logging.handlers

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
target = logging.FileHandler(f"out/log-rank{rank}.txt")
target.setFormatter(logging.Formatter("%(levelname)s %(name)s %(message)s"))
log = logging.getLogger("train")
log.setLevel(logging.INFO)
log.addHandler(logging.handlers.MemoryHandler(1000, flushLevel=logging.CRITICAL, target=target))
total = torch.zeros(1)
for step in range(50):
    value = torch.tensor([float(step + rank)])
    dist.all_reduce(value)
    total += value
    log.info("step %d reduced %.1f", step, value.item())
print(f"RESULT rank={rank} total={total.item():.1f}", flush=True)
dist.destroy_process_group()
