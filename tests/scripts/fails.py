"""A torchrun script that fails as users' scripts do (no ddpd import).

    torchrun --standalone --nproc_per_node=2 fails.py --rank 1 --exit-code 3
    torchrun --standalone --nproc_per_node=2 fails.py --rank 1 --raise

After joining, rank RANK either calls ``sys.exit(EXIT_CODE)`` or raises ValueError("bad batch")
from ``load_batch``, a function of its own; the other ranks wait for it in a barrier.
"""

import argparse
import sys

import torch.distributed as dist


def load_batch(rank):
    raise ValueError(f"bad batch on rank {rank}")


def main(args):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == args.rank:
        if args.raise_:
            load_batch(rank)
        sys.exit(args.exit_code)
    dist.barrier()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, default=1)
    parser.add_argument("--exit-code", type=int, default=3)
    parser.add_argument("--raise", dest="raise_", action="store_true")
    main(parser.parse_args())
