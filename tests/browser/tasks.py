"""A task for the browser tests, importable as ``tests.browser.tasks:chatty``: the built-in two-layer
task, slowed to `options["step_sleep"]` seconds a step (0.05), printing one line a step so the page
has logs to follow while the curve grows."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from ddpd.worker.tasks import Task, TaskContext, two_layer


def chatty(ctx: TaskContext) -> Task:
    task = two_layer(ctx)
    pause = float(ctx.options.get("step_sleep", 0.05))
    batches = task.batches
    assert batches is not None

    def slow_batches(index: int) -> Any:
        time.sleep(pause)
        return batches(index)

    def on_step(step: int) -> None:
        print(f"rank {ctx.rank} at step {step}", flush=True)

    return dataclasses.replace(task, batches=slow_batches, on_step=on_step)


NARROW_TOP, NARROW_DROP = 1.0051, 0.0014  # a loss from 1.0051 down to 1.0037


def narrow(ctx: TaskContext) -> Task:
    """`chatty` whose loss barely moves: NARROW_TOP at step 1, down to NARROW_TOP - NARROW_DROP at
    step `span` (option, 40), flat after; for a chart whose ticks need more than three digits."""
    task = chatty(ctx)
    span = int(ctx.options.get("span", 40))
    at = [1]
    inner = task.on_step
    assert inner is not None

    def on_step(step: int) -> None:
        at[0] = step
        inner(step)

    def loss(output: Any, batch: Any) -> Any:
        moved = NARROW_DROP * min(at[0] - 1, span) / span
        return task.loss(output, batch) * 0 + (NARROW_TOP - moved)  # the graph kept: backward still runs

    return dataclasses.replace(task, loss=loss, on_step=on_step)
