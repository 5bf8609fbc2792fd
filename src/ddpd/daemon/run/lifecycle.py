"""Every job-state decision, as pure functions: all ranks joined, after an attempt, after a daemon
restart, whether a job may be removed; the one set of ACTIVE states.

The scheduler and the attempt's frame reader apply these decisions through the journal (which
checks each transition against `protocol.states`); nothing here does I/O or reads a clock.
"""

from __future__ import annotations

from typing import assert_never

from ...protocol import JobState
from .outcome import AttemptEnd

ACTIVE = frozenset({JobState.STARTING, JobState.RUNNING, JobState.RESTARTING})


def after_attempt(end: AttemptEnd, reason: str, *, attempt: int, max_restarts: int, cancel_requested: bool,
                  accepting: bool) -> JobState:
    """The job's next state once attempt number `attempt` (1-based) ended as `end`; every end has its
    state here (mypy checks the match is exhaustive).

    A daemon stopping sends the job back to the queue; a preempted job is PREEMPTED (then queued
    again, `after_preemption`); re-forming nodes restart it. A failure or
    timeout restarts while restarts remain, unless it ran out of wall time (counted from the first
    start), was cancelled, or the daemon stops taking work; anything else is final as it ended.
    """
    match end:
        case AttemptEnd.DAEMON_STOPPING:
            return JobState.QUEUED
        case AttemptEnd.REFORMING:
            return JobState.RESTARTING
        case AttemptEnd.PREEMPTED:
            return JobState.PREEMPTED
        case AttemptEnd.SUCCEEDED:
            return JobState.SUCCEEDED
        case AttemptEnd.CANCELLED:
            return JobState.CANCELLED
        case AttemptEnd.FAILED | AttemptEnd.TIMED_OUT:
            restarts_used = attempt - 1
            if restarts_used < max_restarts and reason != "wall_time" and not cancel_requested and accepting:
                return JobState.RESTARTING
            return JobState.FAILED if end is AttemptEnd.FAILED else JobState.TIMED_OUT
        case _:
            assert_never(end)


def after_preemption(state: JobState) -> JobState | None:
    """A PREEMPTED job goes back to the queue, to resume from its checkpoint (None: it is not preempted)."""
    return JobState.QUEUED if state is JobState.PREEMPTED else None


def after_daemon_restart(state: JobState, *, attempt: int, max_restarts: int) -> JobState | None:
    """What a job found by recovery becomes: None when it stays as it is (queued or ended).

    A job that was starting or running lost its attempt: it is queued again while it has a restart
    left (the lost attempt counts as one), and fails otherwise.
    """
    if state is JobState.PREEMPTED:  # its checkpoint is on disk: queued again, no restart spent
        return JobState.QUEUED
    if state not in ACTIVE:
        return None
    return JobState.QUEUED if attempt <= max_restarts else JobState.FAILED


def when_joined(state: JobState, joined: int, nproc: int) -> JobState | None:
    """A starting job is running once every rank joined the process group."""
    return JobState.RUNNING if state is JobState.STARTING and joined == nproc else None


def removal_refused(state: JobState) -> str | None:
    """Why `rm` refuses a job in this state, or None when it may be removed (only ended jobs)."""
    return None if state.final else f"the job is {state.value}: cancel it first, or wait for it to end"
