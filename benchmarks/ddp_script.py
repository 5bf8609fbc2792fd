"""The standalone DDP program that torchrun and mp.spawn run: the same work as ddpd's built-in tasks.

    torchrun --nproc-per-node 2 --master-port P benchmarks/ddp_script.py --task two-layer --stamps DIR
    python benchmarks/ddp_script.py --spawn 2 --task mlp --steps 300 --stamps DIR   (mp.spawn)

Tasks mirror ``ddpd.worker.tasks``: ``two-layer`` is the classic TwoLinLayerNet program (one
fixed input per rank, loss ``(a + b).sum()``) and ``mlp`` is `layers` Linear(width, width)+ReLU
blocks on a batch of 64 rows with an MSE loss; both take SGD steps (lr 0.01) as ddpd's loop does.
Threads are left as each launcher leaves them (torchrun sets OMP_NUM_THREADS=1, mp.spawn does not).

Each rank writes ``DIR/rank-R.json`` (atomically, rewritten as it goes) with its pid, the
``time.time()`` at which ``init_process_group`` returned (``init``), at which step `warmup` ended
(``warm``) and at which the last step ended (``end``), and the steps done. The benchmark reads
these to measure launch time, steady-state throughput and to find a rank to kill.

No ddpd import here: this is what a user would write without ddpd.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--spawn", type=int, default=0, help="start this many ranks with mp.spawn (else: torchrun env)")
    p.add_argument("--task", choices=["two-layer", "mlp"], default="two-layer")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=0, help="steps before the steady-state clock starts")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stamps", type=Path, required=True)
    p.add_argument("--checkpoint-every", type=int, default=0,
                   help="rank 0 saves model, optimizer and step to --checkpoint every N steps; a restart resumes")
    p.add_argument("--checkpoint", type=Path, help="the checkpoint file (with --checkpoint-every)")
    p.add_argument("--kill-at", type=int, default=0,
                   help="rank 1 SIGKILLs itself at the start of this step, once (--kill-marker says it did)")
    p.add_argument("--kill-marker", type=Path, help="written (the time) by rank 1 just before it kills itself")
    return p.parse_args(argv)


def stamp(args: argparse.Namespace, rank: int, **fields: Any) -> None:
    path = args.stamps / f"rank-{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"rank": rank, "pid": os.getpid(), **fields}))
    os.replace(tmp, path)


def worker(rank: int, world_size: int, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", rank=rank, world_size=world_size)  # env://: MASTER_ADDR, MASTER_PORT
    t_init = time.time()
    stamp(args, rank, init=t_init)

    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank + 1)
    model: nn.Module
    if args.task == "two-layer":

        class TwoLinLayerNet(nn.Module):  # type: ignore[misc]
            def __init__(self) -> None:
                super().__init__()
                self.a = nn.Linear(10, 10, bias=False)
                self.b = nn.Linear(10, 1, bias=False)

            def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                return self.a(x), self.b(x)

        model = TwoLinLayerNet()
        inp = torch.randn(10, 10, generator=gen)

        def loss_fn(out: Any) -> torch.Tensor:
            a, b = out
            return (a + b).sum()

    else:
        blocks: list[nn.Module] = []
        for _ in range(args.layers):
            blocks += [nn.Linear(args.width, args.width), nn.ReLU()]
        model = nn.Sequential(*blocks)
        inp = torch.randn(args.batch, args.width, generator=gen)
        target = torch.randn(args.batch, args.width, generator=gen)
        mse = nn.MSELoss()

        def loss_fn(out: Any) -> torch.Tensor:
            return mse(out, target)

    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    start = 0
    keep = args.checkpoint_every > 0 and args.checkpoint is not None
    if keep and args.checkpoint.exists():  # a restart (torchrun --max-restarts): resume where it was saved
        saved = torch.load(args.checkpoint, weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        start = int(saved["step"])
    t_warm = time.time()
    for step in range(start + 1, args.steps + 1):
        if step == args.kill_at and rank == 1 and args.kill_marker is not None and not args.kill_marker.exists():
            args.kill_marker.write_text(repr(time.time()))
            os.kill(os.getpid(), 9)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(ddp(inp))
        loss.backward()
        optimizer.step()
        _ = loss.item()
        if step == max(1, args.warmup):
            t_warm = time.time()
            stamp(args, rank, init=t_init, warm=t_warm, warm_step=step)
        if keep:  # where this rank is, for the restart benchmark: its step, and the first one after a restart
            if rank == 0 and step % args.checkpoint_every == 0:
                tmp = args.checkpoint.with_suffix(".tmp")
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, tmp)
                os.replace(tmp, args.checkpoint)
            if step == start + 1:
                t_first = time.time()
            stamp(args, rank, init=t_init, step=step, resumed_from=start, first_step_at=t_first,
                  restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    t_end = time.time()
    stamp(args, rank, init=t_init, warm=t_warm, warm_step=max(1, args.warmup), end=t_end, steps=args.steps)
    dist.destroy_process_group()


def main() -> None:
    args = parse_args()
    args.stamps.mkdir(parents=True, exist_ok=True)
    if args.spawn:
        import torch.multiprocessing as mp

        mp.spawn(worker, args=(args.spawn, args), nprocs=args.spawn)
    else:
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)


if __name__ == "__main__":
    main()
