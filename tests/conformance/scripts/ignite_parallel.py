"""pytorch-ignite: ``idist.Parallel(backend="gloo")`` runs the training function on the ranks the
launcher started; ``auto_model``/``auto_optim``/``auto_dataloader``, an ``Engine`` for two epochs,
rank 0 saves the model's state.

    torchrun --nproc-per-node 2 ignite_parallel.py   # writes out/ignite.pt
"""

import gc
from typing import Any

import ignite.distributed as idist
import torch
from ignite.engine import Engine
from torch.utils.data import TensorDataset


def training(local_rank: int, config: dict[str, Any]) -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
    model = idist.auto_model(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
    optimizer = idist.auto_optim(torch.optim.SGD(model.parameters(), lr=0.05))
    loader = idist.auto_dataloader(data, batch_size=16, shuffle=False, num_workers=0)

    def step(engine: Engine, batch: list[torch.Tensor]) -> float:
        x, y = batch
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        return loss.item()

    trainer = Engine(step)
    trainer.run(loader, max_epochs=2)
    module = model.module if hasattr(model, "module") else model
    if idist.get_rank() == 0:
        torch.save(module.state_dict(), "out/ignite.pt")
    checksum = sum(p.detach().double().sum().item() for p in module.parameters())
    print(f"RESULT rank={idist.get_rank()} world={idist.get_world_size()} loss={trainer.state.output:.6f} "
          f"checksum={checksum:.6f} steps={trainer.state.iteration}", flush=True)


with idist.Parallel(backend="gloo") as parallel:
    parallel.run(training, {})
    gc.collect()  # the DDP wrapper freed while the interpreter runs; Parallel's exit destroys the group
