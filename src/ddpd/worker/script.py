"""Script mode: run an unmodified torchrun script as this rank.

The daemon has put torchrun's variables in the environment (RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE=True, ...). The script runs as
``__main__`` with its own ``sys.argv``; ``init_process_group`` is wrapped so the daemon sees
the rank join. A script may call
``init_process_group`` again after destroying its group (an evaluation loop): each re-join
rendezvouses in the job's store under a prefix of its own (`rejoin_arguments`).

Progress without code changes: every ``optimizer.step()`` of any optimizer is counted (torch's
global optimizer step hook), so the step counter, steps per second, the progress timeout and
hang detection work for an unmodified script; its first counted step makes the rank TRAINING.
A script that calls ``ddpd.worker.api.report`` is counted by its reports from then on. A script
that never steps an optimizer (an evaluation) and never reports has no step counter: the
progress timeout does not apply to it (the heartbeat and wall-time limits still do).

Nothing the script leaves is destroyed before the rank leaves with ``os._exit``: its globals (the
module dict ``runpy`` returns, or the frames of a ``SystemExit`` mid-script), and every process
group it created, even one it destroyed (`keep_process_groups`). Freeing a DDP model after its
group was destroyed runs gloo's destructor under the GIL while a gloo thread waits for the GIL
(torch 2.13: ``Reducer::~Reducer`` -> ``ProcessGroupGloo::~ProcessGroupGloo``): the rank hangs at
exit with its heartbeat thread starved. A group the script left initialized is left so; the
rank tells the daemon it finished (``PhaseChanged("done")``) before anything else runs.
"""

from __future__ import annotations

import functools
import inspect
import os
import runpy
import sys
from datetime import timedelta
from types import FrameType
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.optim.optimizer import register_optimizer_step_post_hook

from ddpd.protocol.channel import Assign, PhaseChanged, Result

from .loop import env_collective_timeout, require_cuda
from .runtime import Runtime


def rejoin_arguments(real: Any, joins: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The arguments of a re-join (`joins` > 1) through the environment: the same store, under a
    prefix of this join's own.

    torch names the default group alike on every init and keeps its keys in the job's store, so a
    re-init would read the previous group's addresses (gloo then connects to a listener that is
    gone). Every rank calls init_process_group as often as the others, so their counts agree.
    A script that passes its own store or init method is left as it is."""
    arguments = inspect.signature(real).bind_partial(*args, **kwargs).arguments
    if arguments.get("store") is not None or arguments.get("init_method") not in (None, "env://"):
        return arguments
    extra = {"timeout": timeout} if (timeout := arguments.get("timeout")) is not None else {}
    store, rank, world_size = next(dist.rendezvous("env://", arguments.get("rank", -1),
                                                   arguments.get("world_size", -1), **extra))
    arguments.pop("init_method", None)
    arguments.update(store=dist.PrefixStore(f"ddpd-rejoin-{joins}", store), rank=rank, world_size=world_size)
    return arguments


def default_timeout(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The script's keyword arguments with the daemon's collective timeout (``DDPD_COLLECTIVE_TIMEOUT``,
    past its own hang diagnosis) where the script gives none: torch's default (10 min for NCCL)
    would race the daemon's progress watch and end a waiting peer first, naming the wrong rank."""
    seconds = env_collective_timeout()
    if len(args) >= 3 or kwargs.get("timeout") is not None or seconds is None:
        return kwargs
    return {**kwargs, "timeout": timedelta(seconds=seconds)}


def wrap_init_process_group(runtime: Runtime) -> None:
    """Report `store_connected` before and `joined` after the script's init_process_group."""
    real = c10d.init_process_group
    joins = 0

    @functools.wraps(real)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        nonlocal joins
        joins += 1
        runtime.phase = "store_connected"
        runtime.send(PhaseChanged(phase="store_connected"))
        kwargs = default_timeout(args, kwargs)
        if joins > 1:
            kwargs, args = rejoin_arguments(real, joins, args, kwargs), ()
        result = real(*args, **kwargs)
        runtime.phase = "joined"
        runtime.send(PhaseChanged(phase="joined"))
        return result

    dist.init_process_group = init_process_group
    c10d.init_process_group = init_process_group


def keep_process_groups(runtime: Runtime) -> None:
    """Keep every process group the script destroys alive until `os._exit` (see the module's doc):
    `destroy_process_group` only unregisters it, as before, and nothing frees it afterwards."""
    real = c10d.destroy_process_group

    @functools.wraps(real)
    def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
        group = kwargs.get("group", args[0] if args else None)
        runtime.keepalive.extend(list(c10d._world.pg_map) if group is None else [group])  # None: all of them
        return real(*args, **kwargs)

    dist.destroy_process_group = destroy_process_group
    c10d.destroy_process_group = destroy_process_group


# functions that call `optimizer.step()` to build an optimizer's state, not to train: torch's
# `get_state_dict`/`get_optimizer_state_dict` step a fresh optimizer once with zero gradients
STATE_INITIALISERS = frozenset({"_init_optim_state"})
CALLER_DEPTH = 6  # frames above the hook looked at: the optimizer's step wrappers, then its caller


def initialising_state() -> bool:
    """Whether the optimizer step being counted is one of STATE_INITIALISERS' (not a training step)."""
    frame: FrameType | None = sys._getframe(2)
    for _ in range(CALLER_DEPTH):
        if frame is None:
            return False
        if frame.f_code.co_name in STATE_INITIALISERS:
            return True
        frame = frame.f_back
    return False


def count_optimizer_steps(runtime: Runtime) -> Any:
    """Count every optimizer step of the script (the hook's handle: `.remove()` stops it), but not
    the one torch's distributed state-dict helpers take to initialise a fresh optimizer's state."""

    def counted(optimizer: Any, args: Any, kwargs: Any) -> None:
        if not initialising_state():
            runtime.count_step()

    return register_optimizer_step_post_hook(counted)


def run_script(runtime: Runtime, assign: Assign) -> Result:
    spec = assign.spec
    if not spec.script:
        raise ValueError("script mode without a script")
    target, *args = spec.script
    wrap_init_process_group(runtime)
    keep_process_groups(runtime)
    count_optimizer_steps(runtime)
    require_cuda(spec)
    try:
        runtime.keepalive.append(execute(target, args, spec.module))
    except SystemExit as exc:
        runtime.keepalive.append(exc)  # its traceback holds the script's frames, and so its globals
        if exc.code not in (None, 0):
            raise
    runtime.finished()
    runtime.keepalive.extend(list(c10d._world.pg_map))
    return Result(steps=runtime.step, loss=runtime.loss)


def execute(target: str, args: list[str], module: bool) -> dict[str, Any]:
    """Run the script as ``__main__``; its globals (which the caller keeps: freeing them is what hangs).
    `sys.orig_argv` is what torchrun's rank was started with (``python -u [-m] TARGET ARGS``), not
    this worker's command line, which a script that re-executes itself would run again."""
    sys.orig_argv = [sys.executable, "-u", *(["-m"] if module else []), target, *args]
    if module:
        sys.argv = [target, *args]
        sys.path.insert(0, os.getcwd())
        return runpy.run_module(target, run_name="__main__", alter_sys=True)
    path = os.path.abspath(target)
    sys.argv = [path, *args]
    sys.path.insert(0, os.path.dirname(path))
    return runpy.run_path(path, run_name="__main__")
