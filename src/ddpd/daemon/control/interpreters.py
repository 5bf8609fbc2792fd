"""The submit-time interpreter check, off the event loop, bounded, and remembered for a while.

`check_interpreter` (identity.py) runs `python -c "import torch, ddpd.worker"` as the submitter
with the job's environment: about two seconds of `import torch`. It runs here in a worker thread
of its own small limiter (a burst of submits cannot park the threads the database needs), and a
success is remembered for CACHE_SECONDS per (uid, interpreter, environment), so back-to-back
submits from one shell pay it once. Failures are never remembered: the user may fix them.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Mapping

import anyio
import anyio.to_thread

from ..contain.identity import Identity, check_interpreter

CACHE_SECONDS = 600.0
CACHE_SIZE = 256
CONCURRENT_CHECKS = 4


# what decides whether `import torch, ddpd.worker` works: the rest (PWD, a prompt, a token) does not,
# so a submit from another directory of the same shell is not checked again
_IMPORT_ENV_PREFIXES = ("PYTHON", "LD_", "PATH", "VIRTUAL_ENV", "CONDA_", "HOME")


def environment_digest(env: Mapping[str, str]) -> str:
    """A digest of the variables that decide an import (names and values, order-free): a cache key,
    never the values themselves."""
    h = hashlib.sha256()
    for key in sorted(k for k in env if k.startswith(_IMPORT_ENV_PREFIXES)):
        h.update(key.encode("utf-8", "surrogateescape") + b"\0" + env[key].encode("utf-8", "surrogateescape") + b"\0")
    return h.hexdigest()


class InterpreterChecks:
    """`refusal(identity, python, env, timeout)`: why the job's interpreter cannot run, or None."""

    def __init__(self) -> None:
        self._ok: OrderedDict[tuple[int, str, str], float] = OrderedDict()
        self._limiter: anyio.CapacityLimiter | None = None

    async def refusal(self, identity: Identity, python: str, env: Mapping[str, str], timeout: float) -> str | None:
        key = (identity.uid, python, environment_digest(env))
        seen = self._ok.get(key)
        if seen is not None and time.monotonic() - seen < CACHE_SECONDS:
            return None
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(CONCURRENT_CHECKS)
        reason = await anyio.to_thread.run_sync(check_interpreter, identity, python, dict(env), timeout,
                                                limiter=self._limiter)
        if reason is None:
            self._ok[key] = time.monotonic()
            self._ok.move_to_end(key)
            while len(self._ok) > CACHE_SIZE:
                self._ok.popitem(last=False)
        return reason
