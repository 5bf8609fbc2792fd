"""A complete user task for ddpd's built-in training loop: a small regression MLP.

Run it from this directory (ddpctl sends the current directory as the job's working
directory, so ``mytask`` is importable by every rank):

    cd examples
    ddpctl submit --task mytask:make_task --nproc 2 --steps 50 --option lr=0.05 --follow

Each rank calls ``make_task`` once with its TaskContext. The loop then moves the model to the
rank's device, wraps it in DistributedDataParallel, reads ``dataset`` through a
DistributedSampler (each rank gets its own shard), and runs ``ctx.steps`` optimizer steps with
checkpoints (``--checkpoint-every``), progress reports and graceful stop.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

from ddpd.worker.tasks import Task, TaskContext


def make_task(ctx: TaskContext) -> Task:
    torch.manual_seed(ctx.seed)  # the same initial weights on every rank
    width = int(ctx.options.get("width", 32))
    lr = float(ctx.options.get("lr", 0.05))

    # data: y = x @ w_true + noise, the same dataset on every rank (the sampler shards it)
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(512, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g) + 0.01 * torch.randn(512, 1, generator=g)

    model = nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, 1))
    mse = nn.MSELoss()

    return Task(
        model=model,
        dataset=TensorDataset(x, y),
        batch_size=int(ctx.options.get("batch_size", 32)),
        # the loop calls model(inputs) for an (inputs, targets) batch; loss gets the output and the batch
        loss=lambda output, batch: mse(output, batch[1]),
        optimizer=lambda params: torch.optim.Adam(params, lr=lr),
    )
