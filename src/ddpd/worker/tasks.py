"""The task interface of the built-in training loop, and the built-in tasks.

A task is a factory ``factory(ctx: TaskContext) -> Task`` named in the job spec as a built-in
(``two-layer``, ``mlp``) or as ``package.module:factory`` (imported with the job's working
directory, else the current directory, first on ``sys.path``). Each rank calls the factory once,
before it connects to the rendezvous store. The loop then moves ``Task.model`` to the rank's
device, wraps it in DistributedDataParallel and runs ``ctx.steps`` optimizer steps.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ddpd.protocol.spec import BUILTIN_TASKS

Options = dict[str, str | int | float | bool]


@dataclass(frozen=True)
class TaskContext:
    """What a task factory knows about its rank. `options` is the job spec's `options` mapping."""

    rank: int
    world_size: int
    local_rank: int
    device: Any  # torch.device
    steps: int
    seed: int
    options: Options = field(default_factory=dict)


@dataclass
class Task:
    """A model, its data, its loss and its optimizer.

    Data: give either `batches` or `dataset`.
      - ``batches(i)`` returns micro-batch ``i`` (0-based, counted over the whole run: with
        ``options["accumulate"] = k`` optimizer step ``s`` (1-based) uses micro-batches
        ``(s-1)*k .. s*k-1``). Tensors are moved to the device if they are not there already.
      - ``dataset`` (a ``torch.utils.data.Dataset``) is read through a DataLoader of
        `batch_size` over a DistributedSampler (a new epoch when it runs out).
    Forward: ``forward(model, batch)`` if given; else ``model(batch)`` for a tensor batch and
      ``model(batch[0])`` for an ``(inputs, targets)`` tuple or list.
    Loss: ``loss(output, batch)`` returns a scalar tensor.
    Optimizer: ``optimizer(params)``; default SGD with ``options["lr"]`` (0.01).
    Hook: ``on_step(step)`` runs at the start of every optimizer step (1-based), before its data.
    """

    model: nn.Module
    loss: Callable[[Any, Any], Any]
    batches: Callable[[int], Any] | None = None
    dataset: Any = None
    batch_size: int = 1
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None
    forward: Callable[[nn.Module, Any], Any] | None = None
    on_step: Callable[[int], None] | None = None

    def __post_init__(self) -> None:
        if (self.batches is None) == (self.dataset is None):
            raise ValueError("a Task needs exactly one of `batches` and `dataset`")


TaskFactory = Callable[[TaskContext], Task]


class TwoLinLayerNet(nn.Module):  # type: ignore[misc]
    """The classic DDP example model: two bias-free linear layers applied to the same input."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(10, 10, bias=False)
        self.b = nn.Linear(10, 1, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a(x), self.b(x)


def rank_generator(ctx: TaskContext) -> torch.Generator:
    """A CPU generator seeded per rank (`seed*1000 + rank + 1`): ranks draw different data."""
    return torch.Generator().manual_seed(ctx.seed * 1000 + ctx.rank + 1)


def two_layer(ctx: TaskContext) -> Task:
    """The classic program's model on one fixed random input per rank. Its loss (option ``loss``):
    ``mse`` (the default), the mean squared error of ``a + b`` to the input itself, a target the
    model can learn, so the loss falls as training does (about 2.6 to 1.3 in 20 steps at lr 0.01);
    ``sum``, the seed program's ``(a + b).sum()``, which only shows that gradients flow (it goes
    negative without bound, which reads as divergence)."""
    kind = ctx.options.get("loss", "mse")
    if kind not in ("mse", "sum"):
        raise ValueError(f"option loss={kind!r}: the two-layer task's loss is mse or sum")
    torch.manual_seed(ctx.seed)
    model = TwoLinLayerNet()
    inp = torch.randn(10, 10, generator=rank_generator(ctx)).to(ctx.device)

    def loss(output: tuple[torch.Tensor, torch.Tensor], batch: Any) -> torch.Tensor:
        a, b = output
        return (a + b).sum() if kind == "sum" else nn.functional.mse_loss(a + b, batch)

    return Task(model=model, loss=loss, batches=lambda i: inp)


def mlp(ctx: TaskContext) -> Task:
    """A throughput benchmark: `layers` (4) Linear(`width`, `width`)+ReLU, `batch` (64) rows, MSE."""
    layers = int(ctx.options.get("layers", 4))
    width = int(ctx.options.get("width", 1024))
    batch = int(ctx.options.get("batch", 64))
    torch.manual_seed(ctx.seed)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*blocks)
    gen = rank_generator(ctx)
    x = torch.randn(batch, width, generator=gen).to(ctx.device)
    y = torch.randn(batch, width, generator=gen).to(ctx.device)
    mse = nn.MSELoss()
    return Task(model=model, loss=lambda out, b: mse(out, b[1]), batches=lambda i: (x, y))


def builtin(name: str) -> TaskFactory | None:
    """The factory of a built-in task (``protocol.spec.BUILTIN_TASKS`` names them: ``two-layer`` is
    the function ``two_layer`` of this module); None for any other name."""
    if name not in BUILTIN_TASKS:
        return None
    factory: TaskFactory = globals()[name.replace("-", "_")]
    return factory


def resolve_factory(name: str, workdir: str | None = None) -> TaskFactory:
    """A built-in by name, or ``module:factory`` imported with `workdir` (or cwd) on sys.path."""
    if (factory := builtin(name)) is not None:
        return factory
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"task {name!r} is neither a built-in nor 'module:factory'")
    base = workdir or os.getcwd()
    if base not in sys.path:
        sys.path.insert(0, base)
    factory = getattr(importlib.import_module(module_name), attr)
    if not callable(factory):
        raise TypeError(f"task factory {name!r} is not callable")
    return factory  # type: ignore[no-any-return]


def to_device(batch: Any, device: Any) -> Any:
    """Move the tensors of a (nested) batch to `device`; other values pass through."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, tuple | list):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def default_forward(model: nn.Module, batch: Any) -> Any:
    if isinstance(batch, tuple | list):
        return model(batch[0])
    return model(batch)
