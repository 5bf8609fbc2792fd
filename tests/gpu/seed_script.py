"""The classic DDP program (DESIGN.md) as a torchrun-style script: gloo with CUDA tensors.

Each rank takes GPU ``LOCAL_RANK % device_count`` (two ranks share GPU 0 on a one-GPU machine),
trains TwoLinLayerNet for 20 steps and prints ``SEED done rank=R device=D checksum=C``.
"""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


class TwoLinLayerNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(10, 10, bias=False)
        self.b = nn.Linear(10, 1, bias=False)

    def forward(self, x):
        return self.a(x), self.b(x)


def main():
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    device = int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count()
    torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = TwoLinLayerNet().cuda()
    ddp_model = DistributedDataParallel(model, device_ids=[device])
    inp = torch.randn(10, 10).cuda()
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.01)
    for _ in range(20):
        optimizer.zero_grad()
        a, b = ddp_model(inp)
        (a + b).sum().backward()
        optimizer.step()
    checksum = sum(float(p.detach().sum()) for p in model.parameters())
    print(f"SEED done rank={rank} device={torch.cuda.current_device()} checksum={checksum:.8f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
