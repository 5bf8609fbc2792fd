"""A task for queue and CLI tests: reports what it was given, then holds its first step until a gate opens.

``options["gate"]`` is a file path; step 1 waits until the file exists (or the daemon asks the job
to stop), so a test decides when the job may finish without any sleep on its side.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

from ddpd.worker import api
from ddpd.worker.tasks import Task, TaskContext, two_layer

GATE_LIMIT = 300.0  # a forgotten gate must not keep a worker forever


def _report(ctx: TaskContext) -> None:
    seen = {key: os.environ.get(key) for key in ("CUDA_VISIBLE_DEVICES", "LOCAL_RANK", "RANK", "WORLD_SIZE")}
    print("ddpd-test-env " + json.dumps({"rank": ctx.rank, "cwd": os.getcwd(), **seen}), flush=True)


def make_task(ctx: TaskContext) -> Task:
    _report(ctx)
    task = two_layer(ctx)
    gate = ctx.options.get("gate")
    if not isinstance(gate, str):
        return task

    def on_step(step: int) -> None:
        if step != 1:
            return
        print(f"rank {ctx.rank} waiting for gate", flush=True)
        deadline = time.monotonic() + GATE_LIMIT
        while not os.path.exists(gate) and not api.should_stop():
            if time.monotonic() > deadline:
                sys.exit("gate never opened")
            time.sleep(0.05)
        print(f"rank {ctx.rank} passed the gate", flush=True)

    return dataclasses.replace(task, on_step=on_step)
