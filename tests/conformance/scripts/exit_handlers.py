"""Work a script leaves for the interpreter's exit, as many scripts do without knowing it:

- an ``atexit`` handler that writes ``out/atexit-rank{R}.txt``;
- a CSV of the losses written through a module-level ``open(...)`` never closed (a header and
  100 rows: 101 lines, all of them still in the file object's buffer when the script returns);
- a non-daemon "uploader" thread started as the last thing, which sleeps 1 s and then writes
  ``out/uploaded-rank{R}.txt`` (the interpreter joins it before exiting).

    torchrun --nproc-per-node 2 exit_handlers.py
"""

import atexit
import threading
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()


def goodbye() -> None:
    with open(f"out/atexit-rank{rank}.txt", "w") as f:
        f.write(f"atexit ran on rank {rank}\n")


atexit.register(goodbye)
losses = open(f"out/losses-rank{rank}.csv", "w")  # noqa: SIM115 (never closed: the point)
losses.write("step,loss\n")
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
g = torch.Generator().manual_seed(1 + rank)
for step in range(100):
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    for p in model.parameters():  # data parallel: every rank steps with the mean gradient
        assert p.grad is not None
        dist.all_reduce(p.grad)
        p.grad /= world
    optimizer.step()
    losses.write(f"{step},{loss.item():.6f}\n")
checksum = sum(p.detach().double().sum().item() for p in model.parameters())
print(f"RESULT rank={rank} loss={loss.item():.6f} checksum={checksum:.6f}", flush=True)
dist.destroy_process_group()


def upload() -> None:
    time.sleep(1)
    with open(f"out/uploaded-rank{rank}.txt", "w") as f:
        f.write(f"uploaded checksum {checksum:.6f}\n")


threading.Thread(target=upload, name="uploader").start()
