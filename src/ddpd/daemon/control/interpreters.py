"""The submit-time interpreter check, off the event loop, bounded, fair, contained, remembered a while.

`check_interpreter` runs `python -c "import torch, ddpd.worker"` as the submitter with the job's
environment (a helper process, `ddpd.daemon.contain.helpers`): about two seconds of `import torch`,
and the user's code (a wrapper, a sitecustomize). So:

- each uid runs at most `interpreter_checks_per_user` checks at once (its others wait their turn),
  all users together at most MAX_CHECK_THREADS (worker threads of their own limiter: a burst of
  submits cannot park the threads the database needs); one user's slow checks never hold a slot
  another user needs;
- where the daemon has a cgroup subtree, each check runs in a cgroup of its own
  (``check-<uid>-<n>``), entered before any of the user's code runs (the gate); the cgroup is
  killed and removed when the check ends, so nothing it started (even `setsid`) outlives it, and
  a daemon killed meanwhile leaves cgroups that `CHECKS.sweep` ends at the next start;
- a success is remembered for CACHE_SECONDS per (uid, interpreter, environment), so back-to-back
  submits from one shell pay it once. Failures are never remembered: the user may fix them.
"""

from __future__ import annotations

import errno
import hashlib
import itertools
import os
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping

import anyio
import anyio.to_thread
import structlog

from ..contain.cgroups import Subtree
from ..contain.gate import GATE_CANNOT_RUN, GATE_NOT_FOUND, gate_said
from ..contain.helpers import HelperKind, Place, run_bounded, run_contained
from ..contain.identity import Identity
from ..contain.userslots import UserSlots

log = structlog.get_logger("ddpd")

CACHE_SECONDS = 600.0
CACHE_SIZE = 256
MAX_CHECK_THREADS = 32
CHECKS = HelperKind("interpreter_check", prefix="check-", kill_wait=10.0)  # ``check-<uid>-<n>``
INTERPRETER_CHECK = "import torch, ddpd.worker"
CHECK_OUTPUT_LIMIT = 4096  # bytes of the check's stderr kept for the reason


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
        return await run_contained(CHECKS, self._subtree, f"{identity.uid}-{next(self._serial)}",
                                   lambda place: check_interpreter(identity, python, env, timeout, None, place),
                                   uid=identity.uid, limiter=self._limiter)

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


_MISSING = re.compile(r"No module named '([^']+)'")


def _start_refusal(python: str, who: str, exc: OSError) -> str:
    if isinstance(exc, FileNotFoundError) or exc.errno == errno.ENOENT:
        return f"python {python} does not exist (or a directory on its path is missing)"
    if isinstance(exc, PermissionError) or exc.errno == errno.EACCES:
        return (
            f"python {python} is not executable by {who}: it or a directory on its path (or its symlink's "
            "target) is closed to that user; use an interpreter the user can run"
        )
    return f"python {python} cannot be started as {who}: {exc.strerror or exc}"


_GATE_FAILED = {GATE_NOT_FOUND: errno.ENOENT, GATE_CANNOT_RUN: errno.EACCES}  # the gate's statuses, as errno


def check_interpreter(
    identity: Identity, python: str, env: Mapping[str, str], timeout: float, daemon_uid: int | None = None,
    place: Place | None = None,
) -> str | None:
    """Why `python` cannot run a rank as `identity`, or None when it imports torch and ddpd.worker.

    Runs `python -c "import torch, ddpd.worker"` as the user (`popen_kwargs`) with the job's `env`,
    in `/`, stdin from /dev/null, in a process group of its own that is killed afterwards, for at
    most `timeout` seconds, keeping only the tail of what it writes to stderr. With `place` (e.g. a
    cgroup's `add`), it starts through the gate and is placed before any of the user's code runs;
    the caller kills that cgroup afterwards (what the check left, even `setsid`, ends with it).
    Blocking (a child process and `import torch`, about 2 s): call via anyio.to_thread.
    """
    if not os.path.isabs(python):
        return f"python {python!r} must be an absolute path (ddpctl sends sys.executable or --python PATH)"
    who = f"user {identity.name} (uid {identity.uid})"
    try:
        ran = run_bounded([python, "-c", INTERPRETER_CHECK], env, identity, timeout, place,
                          what="the interpreter check", stderr_keep=CHECK_OUTPUT_LIMIT, daemon_uid=daemon_uid)
    except OSError as exc:
        return _start_refusal(python, who, exc)
    returncode, tail = ran.returncode, ran.stderr
    if returncode is None:
        return f"python {python} did not finish `{INTERPRETER_CHECK}` within {timeout:g} s as {who}"
    if returncode == 0:
        return None
    err = tail.decode(errors="replace")
    said = err.strip().splitlines()[-1] if err.strip() else ""
    if place is not None and returncode in _GATE_FAILED and gate_said(said):
        # the gate could not exec it as the user (env's words, or the Python gate's: the kernel's errno)
        return _start_refusal(python, who, OSError(_GATE_FAILED[returncode], said.rpartition(": ")[2]))
    missing = _MISSING.search(err)
    if missing:
        module = missing.group(1)
        hint = "pip install torch" if module.split(".")[0] == "torch" else "pip install ddpd"
        return (
            f"python {python} cannot import {module} as {who} (No module named '{module}'); "
            f"install it into that environment ({hint})"
        )
    last = err.strip().splitlines()[-1] if err.strip() else f"exit status {returncode}"
    return f"python {python} failed `{INTERPRETER_CHECK}` as {who}: {last}"
