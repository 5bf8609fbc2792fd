"""Rank 1 registers an atexit handler that writes a file, then raises; rank 0 waits in a barrier
for it. Under torchrun rank 1's handler runs and it exits 1 before rank 0 is torn down.
Usage: fails_with_exit_work.py OUTDIR"""

from __future__ import annotations

import atexit
import os
import sys

import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
if rank == 1:
    def at_exit() -> None:
        with open(os.path.join(sys.argv[1], "atexit-1.txt"), "w") as f:
            f.write("atexit ran\n")

    atexit.register(at_exit)
    raise RuntimeError("rank 1 gives up")
dist.barrier()
