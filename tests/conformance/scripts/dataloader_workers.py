"""A data-parallel loop over a DataLoader with worker processes, the dataset a class of this script:
``--context fork`` or ``spawn`` (spawn's workers import this script again as ``__mp_main__``, hence
the ``__main__`` guard), and ``--persistent``: ``persistent_workers=True``, the loader and a live
iterator kept at module level, so its workers are still running when the script returns and only
the interpreter's exit shuts them down. Rank 0 saves the model's state.

    torchrun --nproc-per-node 2 dataloader_workers.py --context fork [--persistent]   # out/model.pt
"""

import argparse

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class Squares(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.full((8,), i / 64.0)
        return x, x.sum(dim=0, keepdim=True) ** 2


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", choices=("fork", "spawn"), required=True)
    parser.add_argument("--persistent", action="store_true")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    data = Squares()
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, shuffle=False), num_workers=2,
                        multiprocessing_context=args.context, persistent_workers=args.persistent)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    seen = 0.0
    for _ in range(2):
        for x, y in loader:
            seen += x.sum().item()
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            for p in model.parameters():  # data parallel: every rank steps with the mean gradient
                assert p.grad is not None
                dist.all_reduce(p.grad)
                p.grad /= world
            optimizer.step()
    if args.persistent:
        batches = iter(loader)  # left alive with the loader's workers
        next(batches)
    if rank == 0:
        torch.save(model.state_dict(), "out/model.pt")
    checksum = sum(p.detach().double().sum().item() for p in model.parameters())
    print(f"RESULT rank={rank} loss={loss.item():.6f} checksum={checksum:.6f} seen={seen:.4f}", flush=True)
    dist.destroy_process_group()
