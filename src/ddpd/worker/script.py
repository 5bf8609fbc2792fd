"""Script mode: run an unmodified torchrun script as this rank.

The daemon has put torchrun's variables in the environment (RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE=True, ...). The script runs as
``__main__`` with its own ``sys.argv``; ``init_process_group`` is wrapped so the daemon sees
the rank join; a process group the script leaves behind is destroyed.

Progress without code changes: every ``optimizer.step()`` of any optimizer is counted (torch's
global optimizer step hook), so the step counter, steps per second, the progress timeout and
hang detection work for an unmodified script; its first counted step makes the rank TRAINING.
A script that calls ``ddpd.worker.api.report`` is counted by its reports from then on. A script
that never steps an optimizer (an evaluation) and never reports has no step counter: the
progress timeout does not apply to it (the heartbeat and wall-time limits still do).
"""

from __future__ import annotations

import functools
import os
import runpy
import sys
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.optim.optimizer import register_optimizer_step_post_hook

from ddpd.protocol.channel import Assign, PhaseChanged, Result

from .runtime import Runtime


def wrap_init_process_group(runtime: Runtime) -> None:
    """Report `store_connected` before and `joined` after the script's init_process_group."""
    real = c10d.init_process_group

    @functools.wraps(real)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        runtime.phase = "store_connected"
        runtime.send(PhaseChanged(phase="store_connected"))
        result = real(*args, **kwargs)
        runtime.phase = "joined"
        runtime.send(PhaseChanged(phase="joined"))
        return result

    dist.init_process_group = init_process_group
    c10d.init_process_group = init_process_group


def count_optimizer_steps(runtime: Runtime) -> Any:
    """Count every optimizer step of the script (the hook's handle: `.remove()` stops it)."""

    def counted(optimizer: Any, args: Any, kwargs: Any) -> None:
        runtime.count_step()

    return register_optimizer_step_post_hook(counted)


def run_script(runtime: Runtime, assign: Assign) -> Result:
    spec = assign.spec
    if not spec.script:
        raise ValueError("script mode without a script")
    target, *args = spec.script
    wrap_init_process_group(runtime)
    count_optimizer_steps(runtime)
    try:
        if spec.module:
            sys.argv = [target, *args]
            sys.path.insert(0, os.getcwd())
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            path = os.path.abspath(target)
            sys.argv = [path, *args]
            sys.path.insert(0, os.path.dirname(path))
            runpy.run_path(path, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise
    if dist.is_initialized():
        dist.destroy_process_group()
    return Result(steps=runtime.step, loss=runtime.loss)
