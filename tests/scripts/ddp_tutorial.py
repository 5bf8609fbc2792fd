"""A DDP training script written the way the PyTorch tutorials write it for torchrun.

Modelled on the tutorials' ``multigpu_torchrun.py`` (a Trainer reading LOCAL_RANK, the
``init_process_group``/``destroy_process_group`` pair imported by name) and ``elastic_ddp.py``
(ToyModel). It knows nothing of ddpd; on a machine without GPUs it trains on the CPU with gloo.

    torchrun --standalone --nproc_per_node=2 ddp_tutorial.py --epochs 2 --lr 0.1
"""

import argparse
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def ddp_setup():
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        init_process_group(backend="nccl")
    else:
        init_process_group(backend="gloo")


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


class MyTrainDataset(Dataset):
    def __init__(self, size):
        g = torch.Generator().manual_seed(0)
        self.data = [(torch.rand(10, generator=g), torch.rand(5, generator=g)) for _ in range(size)]

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        return self.data[index]


class Trainer:
    def __init__(self, model, train_data, optimizer):
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.global_rank = int(os.environ["RANK"])
        self.device = torch.device("cuda", self.local_rank) if torch.cuda.is_available() else torch.device("cpu")
        self.model = model.to(self.device)
        self.train_data = train_data
        self.optimizer = optimizer
        device_ids = [self.local_rank] if torch.cuda.is_available() else None
        self.model = DDP(self.model, device_ids=device_ids)

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.mse_loss(output, targets)
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def _run_epoch(self, epoch):
        self.train_data.sampler.set_epoch(epoch)
        loss = 0.0
        for source, targets in self.train_data:
            loss = self._run_batch(source.to(self.device), targets.to(self.device))
        print(f"[GPU{self.global_rank}] Epoch {epoch} | Steps: {len(self.train_data)} | loss {loss:.6f}")

    def train(self, max_epochs):
        for epoch in range(max_epochs):
            self._run_epoch(epoch)
        checksum = sum(float(p.detach().sum()) for p in self.model.module.parameters())
        print(f"[GPU{self.global_rank}] done checksum {checksum:.8f}")


def main(epochs, lr, batch_size):
    ddp_setup()
    dataset = MyTrainDataset(64)
    train_data = DataLoader(dataset, batch_size=batch_size, pin_memory=True, shuffle=False,
                            sampler=DistributedSampler(dataset))
    model = ToyModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    Trainer(model, train_data, optimizer).train(epochs)
    destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("--epochs", type=int, default=2, help="how many epochs to train")
    parser.add_argument("--lr", type=float, default=0.01, help="learning rate")
    parser.add_argument("--batch_size", type=int, default=8, help="input batch size on each device")
    args = parser.parse_args()
    main(args.epochs, args.lr, args.batch_size)
