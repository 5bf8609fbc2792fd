"""Job and rank state machines: the states and every legal transition, in one place."""

from __future__ import annotations

import enum


class JobState(enum.StrEnum):
    """State of a job.

    QUEUED -> STARTING | CANCELLED | FAILED
    STARTING -> RUNNING | SUCCEEDED | RESTARTING | FAILED | CANCELLED | TIMED_OUT
      (SUCCEEDED: a script whose ranks all exit 0 without ever joining, as torchrun counts it)
    RUNNING -> SUCCEEDED | RESTARTING | FAILED | CANCELLED | TIMED_OUT
    RESTARTING -> STARTING | FAILED | CANCELLED
    STARTING, RUNNING -> PREEMPTED (stopped at an agreed step, checkpointed, for a job of higher priority)
    PREEMPTED -> QUEUED (to resume from its checkpoint) | CANCELLED
    SUCCEEDED, FAILED, CANCELLED, TIMED_OUT are final.
    Any non-final state may go back to QUEUED when the daemon requeues it on recovery.
    """

    QUEUED = "QUEUED"
    STARTING = "STARTING"
    RUNNING = "RUNNING"
    RESTARTING = "RESTARTING"
    PREEMPTED = "PREEMPTED"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    TIMED_OUT = "TIMED_OUT"

    @property
    def final(self) -> bool:
        return self in _FINAL_JOB


_FINAL_JOB = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED, JobState.TIMED_OUT})

_JOB_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset({JobState.STARTING, JobState.CANCELLED, JobState.FAILED}),
    JobState.STARTING: frozenset(
        {JobState.RUNNING, JobState.SUCCEEDED, JobState.RESTARTING, JobState.FAILED, JobState.CANCELLED,
         JobState.TIMED_OUT, JobState.QUEUED, JobState.PREEMPTED}
    ),
    JobState.RUNNING: frozenset(
        {JobState.SUCCEEDED, JobState.RESTARTING, JobState.FAILED, JobState.CANCELLED, JobState.TIMED_OUT,
         JobState.QUEUED, JobState.PREEMPTED}
    ),
    JobState.PREEMPTED: frozenset({JobState.QUEUED, JobState.CANCELLED}),
    JobState.RESTARTING: frozenset({JobState.STARTING, JobState.FAILED, JobState.CANCELLED, JobState.QUEUED}),
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
    JobState.TIMED_OUT: frozenset(),
}


class RankState(enum.StrEnum):
    """State of one rank of one attempt.

    SPAWNED -> CONNECTED -> STORE_CONNECTED -> JOINED -> TRAINING -> EXITED;
    any state may go straight to EXITED (the process ended), and TRAINING
    repeats as the step counter advances.

    A script may call ``init_process_group`` again (destroy and re-init, as some evaluation loops
    do, or a retry after a failed first call): its second STORE_CONNECTED/JOINED is a re-join
    (`is_rejoin`), recorded as such; the rank keeps its state, so a transition never goes back.
    """

    SPAWNED = "SPAWNED"
    CONNECTED = "CONNECTED"
    STORE_CONNECTED = "STORE_CONNECTED"
    JOINED = "JOINED"
    TRAINING = "TRAINING"
    EXITED = "EXITED"

    @property
    def order(self) -> int:
        """Its place along the machine (SPAWNED 0 ... EXITED 5): how far a rank got."""
        return _RANK_ORDER[self]


_RANK_ORDER = {state: n for n, state in enumerate(RankState)}


class TransitionError(ValueError):
    pass


def check_job_transition(old: JobState, new: JobState) -> JobState:
    if new not in _JOB_TRANSITIONS[old]:
        raise TransitionError(f"illegal job transition {old} -> {new}")
    return new


def is_rejoin(old: RankState, new: RankState) -> bool:
    """A join phase (STORE_CONNECTED or JOINED) again, at or after it: a repeated init_process_group."""
    return (new in (RankState.STORE_CONNECTED, RankState.JOINED) and old is not RankState.EXITED
            and new.order <= old.order)


def check_rank_transition(old: RankState, new: RankState) -> RankState:
    """Rank states only move forward (skipping is allowed: a rank may die early)."""
    if old is RankState.EXITED:
        raise TransitionError(f"illegal rank transition {old} -> {new}")
    if new is RankState.TRAINING and old is RankState.TRAINING:
        return new
    if new.order <= old.order:
        raise TransitionError(f"illegal rank transition {old} -> {new}")
    return new
