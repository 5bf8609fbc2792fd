"""The submit-time interpreter check, off the event loop, bounded, fair, contained, remembered a while.

`check_interpreter` (identity.py) runs `python -c "import torch, ddpd.worker"` as the submitter
with the job's environment: about two seconds of `import torch`, and the user's code (a wrapper,
a sitecustomize). So:

- each uid runs at most `interpreter_checks_per_user` checks at once (its others wait their turn),
  all users together at most MAX_CHECK_THREADS (worker threads of their own limiter: a burst of
  submits cannot park the threads the database needs); one user's slow checks never hold a slot
  another user needs;
- where the daemon has a cgroup subtree, each check runs in a cgroup of its own
  (``check-<uid>-<n>``), entered before any of the user's code runs (the gate); the cgroup is
  killed and removed when the check ends, so nothing it started (even `setsid`) outlives it, and
  a daemon killed meanwhile leaves cgroups that `sweep_checks` ends at the next start;
- a success is remembered for CACHE_SECONDS per (uid, interpreter, environment), so back-to-back
  submits from one shell pay it once. Failures are never remembered: the user may fix them.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path

import anyio
import anyio.to_thread
import structlog

from ..contain.cgroups import Cgroup, CgroupError, Subtree
from ..contain.identity import Identity, check_interpreter
from ..contain.userslots import UserSlots

log = structlog.get_logger("ddpd")

CACHE_SECONDS = 600.0
CACHE_SIZE = 256
MAX_CHECK_THREADS = 32
CGROUP_KILL_WAIT = 10.0  # seconds for a check's cgroup to empty once killed
CHECK_PREFIX = "check-"


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


def end_check_cgroup(cgroup: Cgroup) -> None:
    """Kill what is left in a check's cgroup and remove it (blocking); a stuck one is logged and kept."""
    try:
        if cgroup.kill(CGROUP_KILL_WAIT):
            cgroup.remove()
            return
    except (CgroupError, OSError) as exc:
        log.warning("interpreter_check.cgroup_left", cgroup=str(cgroup.path), error=str(exc))
        return
    log.warning("interpreter_check.cgroup_left", cgroup=str(cgroup.path), error="still populated after kill")


def sweep_checks(jobs: Path) -> None:
    """End the check cgroups a killed daemon left under `jobs` (blocking)."""
    for path in jobs.glob(f"{CHECK_PREFIX}*"):
        if path.is_dir():
            end_check_cgroup(Cgroup(path))


class InterpreterChecks:
    """`refusal(identity, python, env, timeout)`: why the job's interpreter cannot run, or None.

    `subtree`: where checks get cgroups of their own (None: process groups only); `per_user`: how
    many checks one uid may run at once (read at each check: a reload changes it)."""

    def __init__(self, subtree: Subtree | None = None, per_user: Callable[[], int] = lambda: 2) -> None:
        self._ok: OrderedDict[tuple[int, str, str], float] = OrderedDict()
        self._limiter: anyio.CapacityLimiter | None = None
        self._subtree = subtree
        self._slots = UserSlots(per_user)
        self._serial = itertools.count(1)

    async def _check(self, identity: Identity, python: str, env: dict[str, str], timeout: float) -> str | None:
        """One check, in a cgroup of its own where there is a subtree (killed and removed afterwards)."""
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(MAX_CHECK_THREADS)
        cgroup = None
        if self._subtree is not None:
            name = f"{CHECK_PREFIX}{identity.uid}-{next(self._serial)}"
            try:
                cgroup = await anyio.to_thread.run_sync(Cgroup.create, self._subtree.jobs, name)
            except OSError as exc:  # the check still runs, in its process group only
                log.warning("interpreter_check.cgroup_unavailable", uid=identity.uid, error=str(exc))
        try:
            return await anyio.to_thread.run_sync(check_interpreter, identity, python, env, timeout, None,
                                                  None if cgroup is None else cgroup.add, limiter=self._limiter)
        finally:
            if cgroup is not None:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(end_check_cgroup, cgroup)

    async def refusal(self, identity: Identity, python: str, env: Mapping[str, str], timeout: float) -> str | None:
        key = (identity.uid, python, environment_digest(env))
        seen = self._ok.get(key)
        if seen is not None and time.monotonic() - seen < CACHE_SECONDS:
            return None
        async with self._slots.slot(identity.uid):
            reason = await self._check(identity, python, dict(env), timeout)
        if reason is None:
            self._ok[key] = time.monotonic()
            self._ok.move_to_end(key)
            while len(self._ok) > CACHE_SIZE:
                self._ok.popitem(last=False)
        return reason
