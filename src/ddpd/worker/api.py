"""An optional API for scripts run by ddpd (script mode); every function is a no-op elsewhere.

A script's optimizer steps are counted without it (torch's global optimizer hook); `report`
replaces that count with the script's own from its first call on (and adds the loss).

    from ddpd.worker import api
    for step in range(1, steps + 1):
        loss = train_one_step()
        api.report(step, loss=loss.item())
        if api.should_stop():
            save_checkpoint(); break
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .runtime import Runtime

_runtime: Runtime | None = None


def bind(runtime: Runtime) -> None:
    """Called by the worker's bootstrap: from now on `report` reaches the daemon."""
    global _runtime
    _runtime = runtime


def in_worker() -> bool:
    """True when running inside a ddpd worker."""
    return _runtime is not None


def report(step: int, loss: Any = None) -> None:
    """Tell the daemon that `step` is done (heartbeats carry it too); `loss` may be a float or tensor."""
    runtime = _runtime
    if runtime is None:
        return
    runtime.report(int(step), None if loss is None else float(loss))


def should_stop() -> bool:
    """True once the daemon asked this job to stop gracefully (checkpoint and exit 0)."""
    return _runtime is not None and _runtime.stop_requested.is_set()
