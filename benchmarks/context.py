"""The plan of one benchmark run (how many repetitions, how long) and what the benchmarks share."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from rich.console import Console

from .common import Daemon, settle
from .results import Metric, Results
from .settle import Settled
from .settle import settle as settle_machine

T = TypeVar("T")


@dataclass(frozen=True)
class Plan:
    short: bool
    launch_reps: int
    detect_reps: int
    throughput_reps: int
    throughput_steps: int
    throughput_warmup: int
    detect_width: int
    idle_window: float
    scale_jobs: int
    scale_ranks: int
    scale_window: float
    status_rate: float
    pool_size: int

    @classmethod
    def make(cls, short: bool, reps: int | None = None, pool_size: int = 2, workers: int = 500) -> Plan:
        jobs = max(1, workers // 50)
        if short:
            return cls(short, reps or 3, reps or 2, reps or 2, 60, 15, 512, 2.0, jobs, workers // jobs, 8.0, 20.0,
                       pool_size)
        return cls(short, reps or 7, reps or 5, reps or 3, 400, 50, 512, 5.0, jobs, workers // jobs, 30.0, 20.0,
                   pool_size)


@dataclass
class Ctx:
    plan: Plan
    token: str
    base: Path
    results: Results
    console: Console
    daemons: dict[str, Daemon] = field(default_factory=dict)

    def say(self, text: str) -> None:
        self.console.print(f"[dim]{text}[/dim]")

    async def settle(self, daemons: Sequence[Daemon] = ()) -> Settled:
        """This run's processes quiet, then every daemon's pool idle and the whole machine quiet
        (benchmarks/settle.py): the same wait before every side."""
        await settle(self.token)
        return await settle_machine([*self.daemons.values(), *daemons])

    async def alternate(self, reps: int, runners: Sequence[tuple[str, Callable[[], Awaitable[T]]]],
                        record: Callable[[str, T], str], metrics: Sequence[Metric],
                        daemons: Sequence[Daemon] = ()) -> None:
        """Repetition after repetition, each launcher in turn, each after the same settle; every
        repetition is kept. A run that fails is counted against its launcher in `metrics`, with why
        (a failed torchrun as a failed ddpd job); a run measured on a machine that never got quiet is
        counted as unsettled there."""
        for rep in range(1, reps + 1):
            for name, run in runners:
                settled = await self.settle(daemons)
                if not settled.quiet:
                    for metric in metrics:
                        metric.mark_unsettled(name)
                try:
                    value = await run()
                except Exception as exc:
                    why = f"rep {rep}: {type(exc).__name__}: {short_why(str(exc))}"
                    for metric in metrics:
                        metric.fail(name, why)
                    self.console.print(f"  {name} rep {rep}: {exc}", style="red", markup=False)  # a log's text
                    continue
                self.say(f"  rep {rep}/{reps} {name:12} {record(name, value)}  ({settled.text()})")


# what names a failure's cause, most telling first: an exception with its message, then words
CAUSES = (re.compile(r"\b\w+(Error|Exception): "), re.compile(r"timed out|exited with|Killed", re.IGNORECASE))


def short_why(text: str, limit: int = 300) -> str:
    """A failure in one line for the table: its first line and the last line of the log that names a
    cause (a torchrun's log ends in its agent's ChildFailedError banner; the cause is above it)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return ""
    out = lines[0]
    for pattern in CAUSES:
        causes = [line for line in lines[1:] if pattern.search(line) and "ChildFailedError" not in line]
        if causes:
            out = f"{lines[0]} ... {causes[-1]}"
            break
    return out if len(out) <= limit else out[: limit - 3] + "..."
