"""The hot-replacement benchmark's ddpd task: the built-in ``mlp``, whose rank 1 SIGKILLs itself at
the start of step ``options["kill_at"]``, once per job (a marker file, ``options["marker"]``, says it
did: the replacement or the restarted attempt redoes that step and trains on). Before dying it
writes the wall-clock time to the marker, the moment the benchmark counts from."""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from pathlib import Path

from ddpd.worker.tasks import Task, TaskContext, mlp


def make(ctx: TaskContext) -> Task:
    task = mlp(ctx)
    kill_at = int(ctx.options["kill_at"])
    marker = Path(str(ctx.options["marker"]))
    if ctx.rank != 1 or marker.exists():
        return task

    def on_step(step: int) -> None:
        if step == kill_at:
            marker.write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)

    return dataclasses.replace(task, on_step=on_step)
