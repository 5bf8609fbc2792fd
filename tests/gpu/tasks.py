"""Task factories of the GPU tier, importable as ``tests.gpu.tasks:<factory>`` (repo root on sys.path).

Each prints one line to its rank's log that the test reads back (``DEVICE ...``, ``DTYPE ...``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from ddpd.worker.tasks import Task, TaskContext, two_layer


def report_device(ctx: TaskContext) -> Task:
    """two-layer, after printing what this rank sees: ``DEVICE <device> count=<n> visible=<CUDA_VISIBLE_DEVICES>``."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    print(f"DEVICE {ctx.device} count={count} visible={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!r}",
          flush=True)
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
