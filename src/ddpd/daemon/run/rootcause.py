"""Who failed first: the root cause of an attempt, told apart from collateral failures."""

from __future__ import annotations

import os
import re
import sysconfig
from dataclasses import dataclass

import msgspec

from ...protocol.channel import Failure
from ...protocol.control import RootCause
from ..contain.procs import Exit

# Errors a rank raises because a peer died or stalled: collateral, not a root cause.
_COLLATERAL = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "DistBackendError",
    "DistNetworkError",
    "NCCL communicator was aborted",
    "Socket Timeout",
    "recvBytes",
    "Timed out waiting",
)


def is_collateral(failure: Failure) -> bool:
    text = f"{failure.error} {failure.message}"
    return any(pattern in text for pattern in _COLLATERAL)


@dataclass
class Evidence:
    rank: int
    state: str
    exit: Exit | None
    failure: Failure | None
    failed_at: float | None  # monotonic time of the first sign of failure
    signals_sent_before_exit: frozenset[str]  # signals the daemon had sent the group before it saw the exit


def _klass(ev: Evidence) -> int | None:
    """0: killed by a signal the daemon did not send; 1: failed on its own; 2: collateral; None: not failed."""
    if ev.exit is not None and ev.exit.signal is not None and ev.exit.signal not in ev.signals_sent_before_exit:
        return 0
    if ev.failure is not None:
        return 2 if is_collateral(ev.failure) else 1
    if ev.exit is not None and ev.exit.code not in (None, 0) and ev.exit.signal is None:
        return 1
    return None


def pick_root_cause(evidence: list[Evidence], attempt: int, reason: str = "rank_failed") -> RootCause | None:
    ranked = [(k, ev.failed_at or 0.0, ev.rank, ev) for ev in evidence if (k := _klass(ev)) is not None]
    if not ranked:
        return None
    _, _, _, ev = min(ranked, key=lambda t: (t[0], t[1], t[2]))
    detail = f"rank {ev.rank} "
    if ev.exit is not None:
        detail += f"died of {ev.exit}"
    else:
        detail += "failed"
    if ev.failure is not None:
        detail += f": {ev.failure.error}: {ev.failure.message}"
    return RootCause(
        reason=reason,
        rank=ev.rank,
        attempt=attempt,
        exit_code=None if ev.exit is None else ev.exit.code,
        signal=None if ev.exit is None else ev.exit.signal,
        phase=ev.failure.phase if ev.failure is not None else ev.state,
        error=None if ev.failure is None else ev.failure.error,
        message=None if ev.failure is None else ev.failure.message,
        traceback=None if ev.failure is None else ev.failure.traceback,
        detail=detail,
    )


# -- hangs: where each rank's main thread was, from its faulthandler dump ------------------------

_FRAME = re.compile(r'^\s+File "(?P<path>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)\s*$')
_THREAD = ("Thread 0x", "Current thread 0x")
_LIBRARY = ("<frozen ", *{p for key in ("stdlib", "platstdlib", "purelib", "platlib")
                          if (p := sysconfig.get_paths().get(key))})
_DDPD = f"{os.sep}ddpd{os.sep}"
_SCRIPT_RUNNER = f"{os.sep}ddpd{os.sep}worker{os.sep}script.py"  # a script rank's main thread runs through it
_RUNPY = (f"{os.sep}runpy.py", "<frozen runpy>")


@dataclass(frozen=True)
class Frame:
    path: str
    line: int
    func: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line} in {self.func}"


@dataclass(frozen=True)
class StackSite:
    """Where a rank's main thread was when its stacks were dumped."""

    rank: int
    innermost: Frame
    where: Frame  # the innermost frame in the job's or ddpd's own code (not the stdlib, not a library)
    finished: bool = False  # the rank had said its task or script returned: it is on its way out

    @property
    def in_torch(self) -> bool:
        """Blocked inside torch (a collective, the autograd engine with DDP's hooks): waiting on peers."""
        return f"{os.sep}torch{os.sep}" in self.innermost.path

    def describe(self) -> str:
        if self.finished:  # after the work, ddpd's own exit path runs: its innermost frame is the news
            return f"rank {self.rank} stuck at exit in {self.innermost}"
        if self.in_torch:
            return f"rank {self.rank} waiting in torch ({self.innermost.func}) at {self.where}"
        return f"rank {self.rank} stuck at {self.where}"


def main_thread_stack(dump: str) -> list[Frame] | None:
    """The main thread's frames, innermost first, from faulthandler output (the first complete one)."""
    frames: list[Frame] | None = None
    for line in dump.splitlines():
        if line.startswith(_THREAD):
            frames = []
            continue
        match = _FRAME.match(line)
        if match is None or frames is None:
            frames = None
            continue
        frames.append(Frame(match["path"], int(match["line"]), match["func"]))
        if match["func"] == "_run_module_as_main":  # the worker runs as `python -m ddpd.worker`
            return frames
    return None


def _user_code(frame: Frame) -> bool:
    """The job's own code: not the stdlib (runpy, threading), not a library (torch), not ddpd."""
    return not frame.path.startswith(_LIBRARY) and _DDPD not in frame.path


def locate(rank: int, dump: str, finished: bool = False) -> StackSite | None:
    """Where the rank's main thread is: a task's innermost frame in its own code or ddpd's loop; a
    script's innermost frame in the script's code (never ddpd's wrappers, runpy or torch)."""
    frames = main_thread_stack(dump)
    if not frames:
        return None
    script = any(f.path.endswith(_SCRIPT_RUNNER) for f in frames)
    own = [f for f in frames if _user_code(f) or (not script and _DDPD in f.path)]
    if not own and script:  # a script installed as a library (-m mypkg.train): its first frame under runpy
        first = next((i for i, f in enumerate(frames) if f.path.endswith(_RUNPY)), 0)
        own = frames[first - 1:first] if first > 0 else []
    return StackSite(rank=rank, innermost=frames[0], where=own[0] if own else frames[0], finished=finished)


def _order(named: list[int], sites: dict[int, StackSite], steps: dict[int, int]) -> list[int]:
    """The named ranks, culprit first: stuck outside torch before waiting in it, then the rank
    furthest behind by its step counter, then as named."""
    def key(r: int) -> tuple[bool, int, int]:
        return (not (r in sites and not sites[r].in_torch), steps.get(r, 0), named.index(r))

    return sorted(named, key=key)


def explain_hang(cause: RootCause, sites: dict[int, StackSite], steps: dict[int, int] | None = None) -> RootCause:
    """Add where each rank was to a hang's root cause (`steps`: each rank's step counter).

    The culprit is named first: a rank stuck outside torch before the ranks only waiting for it
    inside a collective; among ranks all inside torch, the one behind by its step counter (a rank
    that entered a collective its peers never make, one step before them)."""
    if not sites:
        return cause
    steps = steps or {}
    rank = cause.rank
    parts = [cause.detail] if cause.detail else []
    if cause.ranks:
        order = _order(list(cause.ranks), sites, steps)
        rank = order[0]
        cause = msgspec.structs.replace(cause, rank=rank, ranks=order)
    if rank is not None and rank in steps:
        ahead = sorted(r for r in sites if r != rank and steps.get(r, 0) > steps[rank])
        if ahead:
            parts.append(f"rank {rank} is behind: step {steps[rank]}, rank(s) {ahead} at "
                         f"{max(steps[r] for r in ahead)}")
    order = sorted(sites, key=lambda r: (r != rank, r))
    parts.append("; ".join(sites[r].describe() for r in order))
    waiting = [r for r in order if r != rank and sites[r].in_torch]
    if rank is not None and waiting:
        parts.append(f"rank(s) {waiting} wait for rank {rank} inside torch (a collective)")
    return msgspec.structs.replace(cause, detail="; ".join(parts))
