"""Who failed first: the root cause of an attempt, told apart from collateral failures."""

from __future__ import annotations

from dataclasses import dataclass

from ..protocol.channel import Failure
from ..protocol.control import RootCause
from .procs import Exit

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
