"""The environment every rank of an attempt starts with, before the job's own ``env`` (`rank_defaults`).

- ``DDPD_COLLECTIVE_TIMEOUT``, every job's (CPU jobs too): how long a collective may wait before
  the backend gives up (`collective_timeout`), past the daemon's own hang diagnosis. The built-in
  loop passes it to ``init_process_group``; script mode's wrapped ``init_process_group`` passes
  it where the script gives no timeout. Torch's defaults (10 minutes for NCCL, 30 for gloo) would
  race the daemon's progress watch: a waiting peer's watchdog would end the job first, naming the
  wrong rank and leaving no hang dump.
- GPU jobs: NCCL's flight recorder (`nccl_env`).

``TORCH_NCCL_ASYNC_ERROR_HANDLING`` is left alone: torch's default (3: tear down without
``ncclCommAbort``, which can hang) unless the job sets it or the submitter exports it.
"""

from __future__ import annotations

import os
from pathlib import Path

from ...protocol.timeouts import Timeouts, need

TRACE_BUFFER_SIZE = 2000  # NCCL flight recorder entries per rank
# the worker reads the same name (ddpd.worker.loop.COLLECTIVE_TIMEOUT_ENV)
COLLECTIVE_TIMEOUT_ENV = "DDPD_COLLECTIVE_TIMEOUT"
COLLECTIVE_MARGIN = 60.0  # seconds past the daemon's own hang detection and teardown
NCCL_TRACE_PREFIX = "nccl-trace-rank-"  # torch appends the rank


def collective_timeout(timeouts: Timeouts) -> float:
    """Seconds a rank's collective may wait before NCCL (or gloo) gives up on it.

    Past the daemon's own diagnosis: a stuck rank is found by the progress timeout (or the join
    timeout before the first step, whichever is longer), its stacks are dumped and the group is
    torn down within the kill grace. The backend's timeout comes after that, by `COLLECTIVE_MARGIN`,
    so the daemon names the stuck rank before a waiting peer fails with a timeout of its own; it
    still ends a wait that nothing else would (a daemon with the progress watch off).
    """
    detect = max(need(timeouts.progress), need(timeouts.join)) + need(timeouts.heartbeat)
    return detect + need(timeouts.kill_grace) + COLLECTIVE_MARGIN


def nccl_env(attempt_dir: str | os.PathLike[str]) -> dict[str, str]:
    """NCCL's flight recorder for a GPU job's ranks: ``TORCH_NCCL_TRACE_BUFFER_SIZE`` (and its newer
    name ``TORCH_FR_BUFFER_SIZE``) entries, dumped on a timeout (``TORCH_NCCL_DUMP_ON_TIMEOUT``) to
    ``<attempt_dir>/nccl-trace-rank-<rank>``, beside the rank logs.

    ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` is left alone: torch's default (3, tear down without
    ``ncclCommAbort``, which can hang) unless the job or its environment sets it.
    """
    trace = str(Path(attempt_dir) / NCCL_TRACE_PREFIX)
    return {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": str(TRACE_BUFFER_SIZE),
        "TORCH_FR_BUFFER_SIZE": str(TRACE_BUFFER_SIZE),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": trace,
        "TORCH_FR_DUMP_TEMP_FILE": trace,
    }


def rank_defaults(timeouts: Timeouts, attempt_dir: str | os.PathLike[str], *, gpus: bool,
                  hot_replace: bool = False) -> dict[str, str]:
    """What every rank of an attempt starts with before the job's own ``env``: the collective
    timeout (``DDPD_COLLECTIVE_TIMEOUT``, `collective_timeout`: CPU jobs too, the built-in loop and
    script mode's wrapped ``init_process_group`` pass it), and on GPUs the flight recorder (`nccl_env`).
    A GPU job that allows hot replacement aborts its communicator itself when a peer is lost
    (worker.reform), which torch supports with its watchdog's error handling off
    (``TORCH_NCCL_ASYNC_ERROR_HANDLING=0``; the daemon's own hang watch still applies)."""
    env = {COLLECTIVE_TIMEOUT_ENV: f"{collective_timeout(timeouts):g}", **(nccl_env(attempt_dir) if gpus else {})}
    if gpus and hot_replace:
        env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"
    return env
