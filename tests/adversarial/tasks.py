"""Task factories of the hostile-input suite, importable as ``tests.adversarial.tasks:<factory>``."""

from __future__ import annotations

import dataclasses

from ddpd.worker.tasks import Task, TaskContext, two_layer


def huge_failure(ctx: TaskContext) -> Task:
    """Every rank raises at step 1 with a message of `options["size"]` (400,000) characters, as a
    large `load_state_dict` key list does."""
    size = int(ctx.options.get("size", 400_000))

    def on_step(step: int) -> None:
        if step == 1:
            raise RuntimeError("missing keys: " + "k" * size)

    return dataclasses.replace(two_layer(ctx), on_step=on_step)
