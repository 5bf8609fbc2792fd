"""The attempt's decisions on its ranks' exits, as pure functions: no I/O, no clock, no task.

The attempt's loop (`loop.Supervisor`) calls these on `Exited` and `ExitRecorded`, and acts:

- `exit_conclusion`: a rank that did not succeed ends the attempt, unless it is replaced in
  place (`replace.Replacements.refusal` said None). A rank that sent its failure ends it even so
  (it is never replaced once the attempt concluded: the refusal is then `STOPPING`); a rank that
  exited 0 without its result is not a success, and its root cause says so.
- `exit_told`: what the ``rank.exited`` event says of hot replacement: why not, where that is
  news (not when the job allows none, nor when the daemon was stopping the attempt anyway).
- `finished_outcome`: once every rank succeeded, how the attempt ended.
"""

from __future__ import annotations

from ...protocol.control import RootCause
from ..run.outcome import AttemptEnd, Outcome
from .ranks import NOT_ALLOWED, STOPPING, RankHandle


def exit_conclusion(h: RankHandle, ok: bool, refusal: str | None, number: int) -> Outcome | None:
    """How the exit of `h` ends the attempt (None: it goes on, the rank succeeded or is replaced).

    `refusal` is why the rank is not replaced in place (None: it is), judged for a rank that did
    not succeed, with the attempt concluded already when the rank sent its failure.
    """
    if ok:
        return None
    if h.failure is not None:  # it said why it failed, then exited: the attempt ends
        return Outcome(AttemptEnd.FAILED, "rank_failed")
    if refusal is None:
        return None
    cause = None
    if h.exit is not None and h.exit.ok:  # exit 0 without the Result frame: not a success
        cause = RootCause(reason="rank_failed", rank=h.rank.rank, attempt=number, exit_code=0,
                          phase=h.rank.state.value, detail=f"rank {h.rank.rank} exited 0 without sending its result")
    return Outcome(AttemptEnd.FAILED, "rank_failed", cause)


def exit_told(ok: bool, refusal: str | None) -> dict[str, str]:
    """The ``hot_replace`` field of the ``rank.exited`` event, where there is news."""
    if ok or refusal in (NOT_ALLOWED, STOPPING):
        return {}
    return {"hot_replace": refusal or "replacing"}


def finished_outcome(handles: list[RankHandle], nproc: int, script: bool, number: int, *,
                     cancel_requested: str | None, warned: bool, stop_warning_lead: float,
                     wall: float | None) -> Outcome | None:
    """Once every rank has succeeded: how the attempt ended (None while any is missing or running).

    Ranks that stopped early ended on a cancel (CANCELLED) or on the wall-time warning (TIMED_OUT).
    """
    if len(handles) != nproc or not all(h.succeeded(script) for h in handles):
        return None
    stopped = any(h.result is not None and h.result.stopped_early for h in handles)
    if stopped and cancel_requested:
        return Outcome(AttemptEnd.CANCELLED, cancel_requested)
    if stopped and warned:
        step = max(h.rank.step for h in handles)
        return Outcome(AttemptEnd.TIMED_OUT, "wall_time", RootCause(
            reason="wall_time", attempt=number,
            detail=f"stopped at step {step} on the wall-time warning, {stop_warning_lead:.0f}s "
                   f"before the {wall or 0.0:.0f}s limit"))
    return Outcome(AttemptEnd.SUCCEEDED, "all ranks succeeded")
