"""The same settle before every measured side: each side of a benchmark starts on a quiet machine.

A daemon's warm pool refills after each job (new interpreters importing torch), and whatever ran
before a side (a launcher's ranks, another benchmark, another user) may still hold the cores. A side
measured right after another side's job shares the machine with that leftover work, and which side
pays depends on the order (the pool benchmark timed torchrun right after ddpd's job, during the
refill). `settle` waits, for every side alike, until

- every daemon named is idle: its pool refills nothing (``ddpctl daemon``'s pool state), and
- the whole machine is quiet: its busy CPU time (``/proc/stat``, every process, not only this
  run's) stays under `below` cores over `window` seconds;

bounded by `limit` seconds (60, or ``DDPD_BENCH_SETTLE_LIMIT``). It returns how long it waited
and whether it got there: a benchmark counts the sides measured on a machine that never got quiet
and shows them, never silently.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import anyio

CLK_TCK = os.sysconf("SC_CLK_TCK")
WINDOW = 1.0  # seconds the machine must stay quiet
BELOW = 0.25  # cores busy at most, over the window (a daemon and idle ranks use ~0)
# seconds to wait at most before measuring anyway (said as unsettled); DDPD_BENCH_SETTLE_LIMIT
# shortens it for a trial run on a machine known to be busy
LIMIT = float(os.environ.get("DDPD_BENCH_SETTLE_LIMIT", "60"))


@dataclass(frozen=True)
class Settled:
    seconds: float  # waited
    quiet: bool  # False: `limit` ran out first (the side is measured, and counted as unsettled)
    busy: float  # cores busy over the last window

    def text(self) -> str:
        state = "quiet" if self.quiet else f"NOT quiet ({self.busy:.2f} cores busy)"
        return f"settled {self.seconds:.1f}s, {state}"


def busy_ticks() -> tuple[int, int]:
    """(busy, total) clock ticks of every CPU since boot (/proc/stat's first line)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # guest time is already counted in user
    return total - idle, total


async def machine_busy(window: float = WINDOW) -> float:
    """Cores busy on the whole machine over the next `window` seconds."""
    before, _ = busy_ticks()
    await anyio.sleep(window)
    after, _ = busy_ticks()
    return (after - before) / CLK_TCK / window


async def pools_idle(daemons: Iterable[Any]) -> bool:
    """Whether no daemon's pool is starting an interpreter (a daemon without a pool is idle)."""
    for d in daemons:
        info = await d.client.daemon_info()
        if "refilling" in (info.pool_state or ""):
            return False
    return True


async def settle(daemons: Iterable[Any] = (), *, below: float = BELOW, window: float = WINDOW,
                 limit: float = LIMIT) -> Settled:
    """Wait until the daemons' pools are idle and the machine is quiet (see the module's doc)."""
    daemons = list(daemons)
    start = time.perf_counter()
    busy = float("nan")
    while True:
        idle = await pools_idle(daemons)
        busy = await machine_busy(window)
        waited = time.perf_counter() - start
        if idle and busy < below:
            return Settled(waited, True, busy)
        if waited >= limit:
            return Settled(waited, False, busy)
