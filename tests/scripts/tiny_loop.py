"""The smallest DDP script a new user writes, all at module level (no ddpd import, no functions):

    torchrun --standalone --nproc_per_node=2 tiny_loop.py STEPS WIDTH BATCH LAYERS

STEPS steps of LAYERS x (Linear(WIDTH, WIDTH), ReLU) under DDP on a fixed random batch, SGD, MSE;
``destroy_process_group()`` as its last line, the model still alive.
"""

import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

steps, width, batch, layers = map(int, sys.argv[1:5])
dist.init_process_group("gloo")
modules = []
for _ in range(layers):
    modules += [torch.nn.Linear(width, width), torch.nn.ReLU()]
model = DistributedDataParallel(torch.nn.Sequential(*modules))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(batch, width), torch.randn(batch, width)
for _ in range(steps):
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
dist.destroy_process_group()
