"""The cost of counting a script's optimizer steps: steps per second with and without the hook.

    python -m benchmarks.optimizer_hook                    # tiny model, 5 rounds of 3000 steps each way
    python -m benchmarks.optimizer_hook --rounds 9 --steps 10000

In one process, in the same run, alternating (the order reverses between rounds): a tiny model
(Linear(10,10), ReLU, Linear(10,1); batch 8; SGD) trained `--steps` steps bare, and the same with
script mode's hook installed (`ddpd.worker.script.count_optimizer_steps` over a real worker
`Runtime`, whose channel is a socketpair drained by a thread, as the daemon drains it). One
intra-op thread. Prints each round's steps per second and the median ratio (hooked / bare);
the target is >= 0.98 (no visible cost). On a shared machine the figures are noisy: read the range.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import threading
import time

import torch
from torch import nn

from ddpd.worker.runtime import Channel, Runtime
from ddpd.worker.script import count_optimizer_steps


def _drain(sock: socket.socket) -> None:
    while sock.recv(1 << 16):
        pass


def steps_per_second(steps: int) -> float:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    inputs = torch.randn(8, 10)
    start = time.perf_counter()
    for _ in range(steps):
        optimizer.zero_grad()
        model(inputs).pow(2).mean().backward()
        optimizer.step()
    return steps / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.optimizer_hook")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3000)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    ours, theirs = socket.socketpair()
    threading.Thread(target=_drain, args=(theirs,), daemon=True).start()
    runtime = Runtime(Channel(ours, os.getpgrp()))
    steps_per_second(args.steps // 10)  # warm-up
    ratios: list[float] = []
    for r in range(args.rounds):
        measured: dict[bool, float] = {}
        for hooked in ((False, True) if r % 2 == 0 else (True, False)):
            handle = count_optimizer_steps(runtime) if hooked else None
            measured[hooked] = steps_per_second(args.steps)
            if handle is not None:
                handle.remove()
        ratios.append(measured[True] / measured[False])
        print(f"round {r + 1}: bare {measured[False]:.0f} steps/s, hooked {measured[True]:.0f} steps/s, "
              f"ratio {ratios[-1]:.3f}")
    print(f"hooked / bare: median {statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f}); "
          f"target >= 0.98; counted {runtime.step} steps")
    ours.close()


if __name__ == "__main__":
    main()
