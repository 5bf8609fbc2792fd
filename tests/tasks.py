"""Task factories for tests, importable as ``tests.tasks:<factory>`` with the repo root on sys.path.

Each builds on the built-in ``two-layer`` task and injects its fault through the Task
interface (the factory itself, the ``on_step`` hook or the ``batches`` callable).
"""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from ddpd.worker.tasks import Task, TaskContext, two_layer

_children: list[subprocess.Popen[bytes]] = []


def _targets(ctx: TaskContext) -> bool:
    return ctx.rank == int(ctx.options.get("rank", 0))


def _slowed(task: Task, seconds: float) -> Task:
    batches = task.batches
    assert batches is not None

    def slow_batches(index: int) -> Any:
        time.sleep(seconds)
        return batches(index)

    return dataclasses.replace(task, batches=slow_batches)


def hang_before_join(ctx: TaskContext) -> Task:
    """Rank `options["rank"]` never returns from the factory, so it never joins."""
    if _targets(ctx):
        threading.Event().wait()
    return two_layer(ctx)


def _at_step(ctx: TaskContext, task: Task, action: Callable[[int], None], default_step: int = 3) -> Task:
    """`task`, where rank `options["rank"]` runs `action(step)` at step `options["at_step"]`."""
    at_step = int(ctx.options.get("at_step", default_step))
    if not _targets(ctx):
        return task

    def on_step(step: int) -> None:
        if step == at_step:
            action(step)

    return dataclasses.replace(task, on_step=on_step)


def _hang(step: int) -> None:
    """Prints ``HANGING at step N`` (a test's handshake: the rank is stuck from then on) and blocks forever."""
    print(f"HANGING at step {step}", flush=True)
    threading.Event().wait()


def _fail(step: int) -> None:
    raise RuntimeError("injected failure")


def hang_in_training(ctx: TaskContext) -> Task:
    """Rank `options["rank"]` blocks forever in Python at step `options["at_step"]`."""
    return _at_step(ctx, two_layer(ctx), _hang)


def fail_at_step(ctx: TaskContext) -> Task:
    """Rank `options["rank"]` raises RuntimeError("injected failure") at step `options["at_step"]`."""
    return _at_step(ctx, two_layer(ctx), _fail)


def slow(ctx: TaskContext) -> Task:
    """two-layer with `options["step_sleep"]` seconds (0.05) of sleep per step."""
    return _slowed(two_layer(ctx), float(ctx.options.get("step_sleep", 0.05)))


def regression(ctx: TaskContext) -> Task:
    """A linear regression over a TensorDataset: exercises the DataLoader/DistributedSampler path."""
    import torch

    torch.manual_seed(ctx.seed)
    gen = torch.Generator().manual_seed(ctx.seed)
    x = torch.randn(64, 4, generator=gen)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    mse = torch.nn.MSELoss()
    return Task(model=torch.nn.Linear(4, 1), loss=lambda out, batch: mse(out, batch[1]),
                dataset=torch.utils.data.TensorDataset(x, y), batch_size=8,
                optimizer=lambda params: torch.optim.SGD(params, lr=0.05))


def spawn_children_reporting(ctx: TaskContext) -> Task:
    """Starts `sleep 1000` in its group and a setsid() escapee, prints ``CHILD_PIDS <in-group> <escapee>``
    to the rank's log, then trains slowly."""
    in_group = subprocess.Popen(["sleep", "1000"])
    escaped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1000)"], start_new_session=True)
    _children.extend((in_group, escaped))
    print(f"CHILD_PIDS {in_group.pid} {escaped.pid}", flush=True)
    return slow(ctx)


def hang_ignoring_sigterm(ctx: TaskContext) -> Task:
    """Every rank ignores SIGTERM; rank `options["rank"]` hangs at step `options["at_step"]` (see `_hang`)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return hang_in_training(ctx)


def garbage_to_daemon(ctx: TaskContext) -> Task:
    """Rank `options["rank"]` writes raw bytes onto its channel to the daemon at step `options["at_step"]`.

    The bytes are `options["garbage"]` (UTF-8) plus a newline, or, with `options["garbage_size"]`,
    that many bytes of ``x`` and no newline (a frame over the size limit).
    """
    import os

    if not _targets(ctx):
        return slow(ctx)
    fd = int(sys.argv[sys.argv.index("--fd") + 1])  # the worker's inherited channel socket
    size = int(ctx.options.get("garbage_size", 0))
    data = b"x" * size if size else str(ctx.options.get("garbage", "{not json")).encode() + b"\n"

    def write(step: int) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]

    return _at_step(ctx, slow(ctx), write, default_step=2)


def fifo_log_then_hang(ctx: TaskContext) -> Task:
    """Rank `options["rank"]` replaces its own stderr log (where the daemon reads its stack dumps) by a
    FIFO (that nobody writes) at step `options["at_step"]`, then blocks forever (prints ``HANGING at
    step N`` first, into its stdout log)."""
    import os

    def action(step: int) -> None:
        path = os.readlink("/proc/self/fd/2")  # the stderr log the daemon opened for it
        print(f"HANGING at step {step}", flush=True)
        os.unlink(path)
        os.mkfifo(path)
        threading.Event().wait()

    return _at_step(ctx, slow(ctx), action)


def flood_heartbeats(ctx: TaskContext) -> Task:
    """Rank `options["rank"]` sends Heartbeat frames on its channel as fast as it can from step
    `options["at_step"]` on (prints ``FLOODING`` first)."""
    import os

    from ddpd.protocol import encode
    from ddpd.protocol.channel import Heartbeat

    fd = int(sys.argv[sys.argv.index("--fd") + 1])  # the worker's inherited channel socket

    def flood(step: int) -> None:
        print("FLOODING", flush=True)
        batch = encode(Heartbeat(step=step)) * 512
        while True:
            view = memoryview(batch)
            while view:
                view = view[os.write(fd, view):]

    return _at_step(ctx, slow(ctx), flood)


def fill_log(ctx: TaskContext) -> Task:
    """Rank `options["rank"]` writes `options["log_bytes"]` bytes (8 MiB) of lines to its log as fast as it
    can at step `options["at_step"]` (prints ``FILLING`` first), then trains on. With `options["wrap"]`
    it never stops: each time it has written `log_bytes` it empties its log and goes on (so the disk
    holds at most `log_bytes` of it)."""
    import os

    total = int(ctx.options.get("log_bytes", 8 << 20))
    wrap = bool(ctx.options.get("wrap", False))
    block = b"".join(b"%07d %s\n" % (i, b"f" * 120) for i in range(8192))  # about 1 MiB of whole lines

    def fill(step: int) -> None:
        print("FILLING", flush=True)
        written = 0
        while True:
            view = memoryview(block)
            while view:
                view = view[os.write(1, view):]  # fd 1 is the rank log (O_APPEND) the daemon opened for it
            written += len(block)
            if written >= total:
                if not wrap:
                    return
                os.ftruncate(1, 0)
                written = 0

    return _at_step(ctx, slow(ctx), fill, default_step=1)


def symlink_log(ctx: TaskContext) -> Task:
    """Each rank with `options["target<rank>"]` replaces its own rank log by a symlink to that path at
    step `options["at_step"]` (prints ``SWAPPED`` first, into the real log), then trains on slowly."""
    import os

    target = ctx.options.get(f"target{ctx.rank}")
    if target is None:
        return slow(ctx)

    def swap(step: int) -> None:
        path = os.readlink("/proc/self/fd/1")  # the rank log the daemon opened for it
        print("SWAPPED", flush=True)
        os.unlink(path)
        os.symlink(str(target), path)

    at_step = int(ctx.options.get("at_step", 2))
    return dataclasses.replace(slow(ctx), on_step=lambda step: swap(step) if step == at_step else None)
