"""Task factories of the GPU tier, importable as ``tests.gpu.tasks:<factory>`` (repo root on sys.path).

Each prints one line to its rank's log that the test reads back (``DEVICE ...``, ``DTYPE ...``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from ddpd.worker.tasks import Task, TaskContext, mlp, two_layer


def device_uuid(device: Any) -> str:
    """The UUID of the physical GPU a CUDA device is, as NVML writes it (``GPU-...``)."""
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"


def report_device(ctx: TaskContext) -> Task:
    """two-layer, after printing what this rank sees: ``DEVICE <device> count=<n> visible=<CUDA_VISIBLE_DEVICES>
    uuid=<the physical GPU's UUID>``."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    uuid = device_uuid(ctx.device) if ctx.device.type == "cuda" else "-"
    print(f"DEVICE {ctx.device} count={count} visible={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!r} "
          f"uuid={uuid}", flush=True)
    if ctx.options.get("require_cuda") and ctx.device.type != "cuda":
        raise RuntimeError(f"expected a CUDA device, got {ctx.device}")
    return two_layer(ctx)


def bf16_probe(ctx: TaskContext) -> Task:
    """two-layer whose forward fails unless it runs under bf16 autocast on CUDA; prints ``DTYPE <dtype>``."""
    task = two_layer(ctx)
    printed = False

    def forward(model: Any, batch: Any) -> Any:
        nonlocal printed
        a, b = model(batch)
        if not printed:
            print(f"DTYPE {a.dtype} device={a.device}", flush=True)
            printed = True
        if a.dtype != torch.bfloat16 or a.device.type != "cuda":
            raise RuntimeError(f"expected bf16 on CUDA, got {a.dtype} on {a.device}")
        return a, b

    return dataclasses.replace(task, forward=forward)


def sync_checked(ctx: TaskContext) -> Task:
    """The ``mlp`` task with ``torch.cuda.set_sync_debug_mode("error")`` over every step after the second
    (DDP rebuilds its buckets in the second forward, copying their indices to the host itself): any
    implicit host-device synchronisation in the built-in loop's step fails the rank. The loop's
    own deliberate reads (a Progress frame's loss, the stop vote) run with the check off; each step
    turns it on again. Prints ``SYNC-CHECKED <n> steps`` at the end."""
    from ddpd.worker import loop

    checked = 0

    def unchecked(method: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            torch.cuda.set_sync_debug_mode(0)
            return method(*args, **kwargs)

        return call

    loop.ProgressReporter.flush = unchecked(loop.ProgressReporter.flush)  # type: ignore[method-assign]
    loop.StopVote.agreed = unchecked(loop.StopVote.agreed)  # type: ignore[method-assign]

    def on_step(step: int) -> None:
        nonlocal checked
        if step >= 3:  # DDP's own first two steps left out (its buckets are built, then rebuilt)
            torch.cuda.set_sync_debug_mode("error")
            checked += 1
        if step == ctx.steps:
            print(f"SYNC-CHECKED {checked} steps", flush=True)

    return dataclasses.replace(mlp(ctx), on_step=on_step)
