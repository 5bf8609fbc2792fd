"""The cost of counting a script's optimizer steps: steps per second with and without the hook.

    python -m benchmarks.optimizer_hook                    # tiny model, 5 rounds of 3000 steps each way
    python -m benchmarks.optimizer_hook --rounds 9 --steps 10000
    python -m benchmarks --only optimizer_hook            # in the suite (--short: 3 rounds of 1000)

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
from typing import Any

import anyio
import anyio.to_thread
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


def measure(rounds: int, steps: int) -> dict[str, Any]:
    """Each round's steps per second bare and hooked, alternating, and the ratios (hooked / bare)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ours, theirs = socket.socketpair()
    threading.Thread(target=_drain, args=(theirs,), daemon=True).start()
    runtime = Runtime(Channel(ours, os.getpgrp()))
    try:
        steps_per_second(steps // 10)  # warm-up
        rows: list[dict[str, float]] = []
        for r in range(rounds):
            measured: dict[bool, float] = {}
            for hooked in ((False, True) if r % 2 == 0 else (True, False)):
                handle = count_optimizer_steps(runtime) if hooked else None
                measured[hooked] = steps_per_second(steps)
                if handle is not None:
                    handle.remove()
            rows.append({"bare": measured[False], "hooked": measured[True],
                         "ratio": measured[True] / measured[False]})
    finally:
        ours.close()
        torch.set_num_threads(threads)
    ratios = [row["ratio"] for row in rows]
    return {"steps": steps, "rounds": rows, "counted": runtime.step, "ratio_median": statistics.median(ratios),
            "ratio_min": min(ratios), "ratio_max": max(ratios)}


def summary(result: dict[str, Any]) -> str:
    return (f"hooked / bare: median {result['ratio_median']:.3f} (range {result['ratio_min']:.3f}-"
            f"{result['ratio_max']:.3f}); target >= 0.98; counted {result['counted']} steps")


async def bench_optimizer_hook(ctx: Any) -> None:
    """The suite's entry (``BENCHES["optimizer_hook"]``): steps/s of the tiny model, bare and hooked."""
    rounds, steps = (3, 1000) if ctx.plan.short else (5, 3000)
    ctx.console.print(f"[bold]optimizer_hook[/bold] (a script's step counter: {rounds} rounds of {steps} steps)")
    result = await anyio.to_thread.run_sync(measure, rounds, steps)
    metric = ctx.results.metric("optimizer_hook.steps", "optimizer_hook",
                                "tiny model steps/s, without and with the step hook", "steps/s",
                                higher_is_better=True)
    for row in result["rounds"]:
        metric.add("bare", row["bare"])
        metric.add("hooked", row["hooked"])
    metric.notes.append(summary(result))
    ctx.say(f"  {summary(result)}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.optimizer_hook")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3000)
    args = p.parse_args(argv)
    result = measure(args.rounds, args.steps)
    for r, row in enumerate(result["rounds"], 1):
        print(f"round {r}: bare {row['bare']:.0f} steps/s, hooked {row['hooked']:.0f} steps/s, "
              f"ratio {row['ratio']:.3f}")
    print(summary(result))


if __name__ == "__main__":
    main()
