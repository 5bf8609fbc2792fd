"""One rank of the forked-ramp benchmark (benchmarks/forked_ramp.py), run as an unmodified script:
the tiny model of the paired benchmark (2 x Linear(32), batch 8, DDP over gloo), a warm-up, then
BLOCKS blocks of STEPS steps, each timed and with the minor page faults the process took during it
(``getrusage``: every thread's). Rank 0 writes one JSON object to OUT."""

import json
import resource
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    out, warmup, blocks, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(),
                                                        torch.nn.Linear(32, 32)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 32), torch.randn(8, 32)

    def run(n: int) -> None:
        for _ in range(n):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()

    run(warmup)
    rates, faults = [], []
    for _ in range(blocks):
        before, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        run(steps)
        elapsed, after = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        rates.append(steps / elapsed)
        faults.append(after - before)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"rates": rates, "faults": faults, "threads": torch.get_num_threads()}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
