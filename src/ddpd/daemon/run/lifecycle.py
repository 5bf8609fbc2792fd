"""Every job-state decision, as pure functions: all ranks joined, after an attempt, after a daemon
restart, whether a job may be removed; the one set of ACTIVE states.

The scheduler and the attempt's frame reader apply these decisions through the journal (which
checks each transition against `protocol.states`); nothing here does I/O or reads a clock.
"""

from __future__ import annotations

from ...protocol import JobState

ACTIVE = frozenset({JobState.STARTING, JobState.RUNNING, JobState.RESTARTING})
RETRYABLE = frozenset({JobState.FAILED, JobState.TIMED_OUT})


def after_attempt(outcome: JobState, reason: str, *, attempt: int, max_restarts: int, cancel_requested: bool,
                  accepting: bool) -> JobState:
    """The job's next state once attempt number `attempt` (1-based) ended with `outcome`.

    QUEUED (the daemon is shutting down) goes back to the queue. A failure or timeout restarts while
    restarts remain, unless it ran out of wall time (counted from the first start), was cancelled, or
    the daemon stops taking work; anything else is final as the attempt ended.
    """
    if outcome is JobState.QUEUED:
        return JobState.QUEUED
    restarts_used = attempt - 1
    if (outcome in RETRYABLE and restarts_used < max_restarts and reason != "wall_time"
            and not cancel_requested and accepting):
        return JobState.RESTARTING
    return outcome


def after_daemon_restart(state: JobState, *, attempt: int, max_restarts: int) -> JobState | None:
    """What a job found by recovery becomes: None when it stays as it is (queued or ended).

    A job that was starting or running lost its attempt: it is queued again while it has a restart
    left (the lost attempt counts as one), and fails otherwise.
    """
    if state not in ACTIVE:
        return None
    return JobState.QUEUED if attempt <= max_restarts else JobState.FAILED


def when_joined(state: JobState, joined: int, nproc: int) -> JobState | None:
    """A starting job is running once every rank joined the process group."""
    return JobState.RUNNING if state is JobState.STARTING and joined == nproc else None


def removal_refused(state: JobState) -> str | None:
    """Why `rm` refuses a job in this state, or None when it may be removed (only ended jobs)."""
    return None if state.final else f"the job is {state.value}: cancel it first, or wait for it to end"
