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
