"""Script mode: run an unmodified torchrun script as this rank.

The daemon has put torchrun's variables in the environment (RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE=True, ...). The script runs as
``__main__`` with its own ``sys.argv``; ``init_process_group`` is wrapped so the daemon sees
the rank join; a process group the script leaves behind is destroyed. Scripts may report
progress with ``ddpd.worker.api.report``.
"""

from __future__ import annotations

import functools
import os
import runpy
import sys
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

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


def run_script(runtime: Runtime, assign: Assign) -> Result:
    spec = assign.spec
    if not spec.script:
        raise ValueError("script mode without a script")
    target, *args = spec.script
    wrap_init_process_group(runtime)
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
