"""``torch.distributed.elastic.multiprocessing.errors.record`` on ``main``: both ranks all-reduce once,
then rank 1 raises (its process group destroyed on the way out, in ``finally``); @record writes the
exception to the error file the launcher gave the rank (TORCHELASTIC_ERROR_FILE), from which the
launcher reports the failure. Rank 0 ends normally.

    torchrun --nproc-per-node 2 record_failure.py   # exits 1, rank 1 named as the failure
"""

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


@record
def main() -> None:
    dist.init_process_group("gloo")
    try:
        rank = dist.get_rank()
        value = torch.ones(1)
        dist.all_reduce(value)
        print(f"RESULT rank={rank} reduced={value.item():.1f}", flush=True)
        if rank == 1:
            raise ValueError(f"bad batch on rank {rank}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
