"""Distributed checkpointing (torch.distributed.checkpoint) after a few data-parallel steps.

``--mode sync``: ``dcp.save`` of the model's and optimizer's state, a fresh model loads it back
(``dcp.load``) and must equal the trained one; ``destroy_process_group()`` at the end.
``--mode async``: the last line is ``dcp.async_save(...)`` whose future is never awaited (the last
iteration of the async-checkpoint recipe): the save finishes while the interpreter exits, before
the ``atexit`` handler that destroys the process group.

    torchrun --nproc-per-node 2 dcp_checkpoint.py --mode sync    # writes out/dcp/{.metadata,*.distcp}
"""

import argparse
import atexit

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

parser = argparse.ArgumentParser()
parser.add_argument("--mode", choices=("sync", "async"), required=True)
args = parser.parse_args()

dist.init_process_group("gloo")
if args.mode == "async":
    atexit.register(dist.destroy_process_group)
rank, world = dist.get_rank(), dist.get_world_size()


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


torch.manual_seed(0)
model = make_model()
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
g = torch.Generator().manual_seed(1 + rank)
for _ in range(5):
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    for p in model.parameters():  # data parallel: every rank steps with the mean gradient
        assert p.grad is not None
        dist.all_reduce(p.grad)
        p.grad /= world
    optimizer.step()
model_state, optim_state = get_state_dict(model, optimizer)
state = {"model": model_state, "optim": optim_state}
checksum = sum(p.detach().double().sum().item() for p in model.parameters())
print(f"RESULT rank={rank} loss={loss.item():.6f} checksum={checksum:.6f}", flush=True)

if args.mode == "sync":
    dcp.save(state, checkpoint_id="out/dcp")
    torch.manual_seed(7)
    fresh = make_model()
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=0.01)
    fresh_model_state, fresh_optim_state = get_state_dict(fresh, fresh_optimizer)
    loaded = {"model": fresh_model_state, "optim": fresh_optim_state}
    dcp.load(loaded, checkpoint_id="out/dcp")
    set_state_dict(fresh, fresh_optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters(), strict=True))
    print(f"RESULT rank={rank} loaded_equal={same}", flush=True)
    dist.destroy_process_group()
else:
    dcp.async_save(state, checkpoint_id="out/dcp")
