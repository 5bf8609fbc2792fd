"""A DDP script over a DataLoader with worker processes, its iterator (and so its workers) left alive
at exit, and no destroy_process_group. It first checks that no thread of the rank is left at idle
CPU priority (a warm-pool interpreter waits at SCHED_IDLE until a job takes it; a CPU job's ranks
then run at SCHED_BATCH, torchrun's at SCHED_OTHER): exit 1 otherwise.

    torchrun --standalone --nproc_per_node=2 dataloader_workers.py
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

idle = [tid for tid in os.listdir("/proc/self/task") if os.sched_getscheduler(int(tid)) == os.SCHED_IDLE]
if idle:
    sys.exit(f"threads {idle} of rank {os.environ['RANK']} are at idle priority")
dist.init_process_group("gloo")
data = TensorDataset(torch.randn(64, 8), torch.randn(64, 8))
loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data), num_workers=2, persistent_workers=True)
model = DistributedDataParallel(torch.nn.Linear(8, 8))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
for x, y in loader:
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
batches = iter(loader)  # left alive, its worker processes too
next(batches)
print("dataloader done", flush=True)
