"""The rank's side of the paired benchmark (benchmarks/paired.py): FIFO gates between segments.

The driver makes, in one directory per side, a FIFO ``go-<rank>`` per rank and one ``done``, and
holds each open read-write (so neither end's open blocks, and a rank's read waits for a byte,
not for a writer). The bare loop (``benchmarks/loop.py --bare --gate DIR --segment N``) runs its
warm-up, then before each segment of N steps reads one byte of its ``go`` FIFO (``g``: run the
segment; end of file or anything else: stop gating and finish). Rank 0 says ``ready POLICY`` on
``done`` before its first wait (POLICY: the scheduling policy it runs with, ``SCHED_OTHER`` or
``SCHED_BATCH``, as the kernel reports it, so the table names what each side ran with), and its
segment's steps per second after each segment, timed from the end of the segment's first step (the
one that picks up after the pause) to the end of its last.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

POLICIES = {getattr(os, name): name
            for name in ("SCHED_OTHER", "SCHED_BATCH", "SCHED_IDLE", "SCHED_FIFO", "SCHED_RR") if hasattr(os, name)}


RESET_ON_FORK = 0x40000000  # a flag or-ed into the policy, not a policy


def policy() -> str:
    """This process's scheduling policy by name (what ``chrt -p`` says)."""
    number = os.sched_getscheduler(0) & ~RESET_ON_FORK
    return POLICIES.get(number, str(number))


class Gate:
    def __init__(self, directory: Path, rank: int, segment: int) -> None:
        if segment < 2:
            raise ValueError(f"--segment must be at least 2 steps, not {segment}")
        self.segment = segment
        self.rank = rank
        self.go = os.open(directory / f"go-{rank}", os.O_RDONLY | os.O_CLOEXEC)
        self.done = os.open(directory / "done", os.O_WRONLY | os.O_CLOEXEC) if rank == 0 else -1
        self.open = True
        self.t0 = 0.0

    def say(self, text: str) -> None:
        if self.rank == 0:
            os.write(self.done, f"{text}\n".encode())

    def wait(self) -> bool:
        """Wait for the driver's go; False once it says no more (the rank then trains ungated)."""
        if self.open and os.read(self.go, 1) != b"g":
            self.open = False
        return self.open

    def run(self, steps: int, step: Callable[[], None]) -> None:
        """`steps` steps in gated segments (a remainder shorter than a segment runs ungated at the end)."""
        self.say(f"ready {policy()}")
        done = 0
        while steps - done >= self.segment and self.wait():
            step()
            t0 = time.perf_counter()
            for _ in range(self.segment - 1):
                step()
            self.say(f"{(self.segment - 1) / (time.perf_counter() - t0):.6f}")
            done += self.segment
        for _ in range(steps - done):
            step()

    def hook(self, warmup: int, rounds: int) -> Callable[[int], None]:
        """The same segments from a step hook called at the start of each step (1, 2, ...): at the
        start of a segment's first step the previous segment is over, at its second step it is timed."""

        def at_step(step: int) -> None:
            k = step - warmup - 1
            if k < 0 or not self.open:
                return
            segment, position = divmod(k, self.segment)
            if position == 1:
                self.t0 = time.perf_counter()
            elif position == 0:
                if segment == 0:
                    self.say(f"ready {policy()}")
                else:
                    self.say(f"{(self.segment - 1) / (time.perf_counter() - self.t0):.6f}")
                if segment < rounds:
                    self.wait()
                else:
                    self.open = False

        return at_step


def gated_mlp(ctx: Any) -> Any:
    """ddpd's built-in ``mlp`` task, gated as the bare loop is (``options``: ``gate``, ``segment``,
    ``warmup``, ``rounds``; the job's steps: warm-up + rounds x segment + 1, the last step's start
    closing the last segment)."""
    import dataclasses

    from ddpd.worker.tasks import mlp

    gate = Gate(Path(str(ctx.options["gate"])), ctx.rank, int(ctx.options["segment"]))
    return dataclasses.replace(mlp(ctx), on_step=gate.hook(int(ctx.options["warmup"]), int(ctx.options["rounds"])))
