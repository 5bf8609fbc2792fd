"""``accelerate.Accelerator(cpu=True)``: a tiny model, optimizer and DataLoader through ``prepare``,
two epochs, then ``save_model`` (safetensors) once every rank is there.

    torchrun --nproc-per-node 2 accelerate_cpu.py   # writes out/accelerate/model.safetensors
"""

import gc

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset

accelerator = Accelerator(cpu=True)
set_seed(0)
g = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=8))
steps = 0
for _ in range(2):
    for x, y in loader:
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        steps += 1
accelerator.wait_for_everyone()
accelerator.save_model(model, "out/accelerate")
checksum = sum(p.detach().double().sum().item() for p in model.parameters())
print(f"RESULT rank={accelerator.process_index} world={accelerator.num_processes} loss={loss.item():.6f} "
      f"checksum={checksum:.6f} steps={steps}", flush=True)
# the DDP wrapper freed and the group destroyed while the interpreter still runs (see test_exit_path.py)
accelerator.free_memory()
del model, optimizer, loader
gc.collect()
accelerator.end_training()
