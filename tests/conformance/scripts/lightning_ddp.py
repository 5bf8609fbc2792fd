"""PyTorch Lightning DDP as its docs show it: ``strategy="ddp"`` on CPU, a tiny model, a fixed seed,
two epochs over synthetic data, then ``trainer.save_checkpoint``. Under torchrun (or anything that
sets its environment) Lightning detects the elastic launcher and does not spawn.

    torchrun --nproc-per-node 2 lightning_ddp.py   # writes out/lightning.ckpt
"""

import gc

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        self.last_loss = 0.0

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.last_loss = loss.item()
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


pl.seed_everything(0, verbose=False)
g = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
model = Tiny()
trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=2, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     deterministic=True)
trainer.fit(model, DataLoader(data, batch_size=8))
trainer.save_checkpoint("out/lightning.ckpt")
checksum = sum(p.detach().double().sum().item() for p in model.parameters())
print(f"RESULT rank={trainer.global_rank} loss={model.last_loss:.6f} checksum={checksum:.6f} "
      f"steps={trainer.global_step}", flush=True)
# the DDP wrapper freed and the group destroyed while the interpreter still runs (see test_exit_path.py)
del trainer
gc.collect()
dist.destroy_process_group()
