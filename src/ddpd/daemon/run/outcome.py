"""How an attempt ended, in its own terms (`AttemptEnd`), why, and what teardown must do first.

The job state it leads to is `lifecycle.after_attempt`'s decision, never the attempt's.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ...protocol.control import RootCause


class AttemptEnd(enum.Enum):
    """How an attempt ended. The values are the names a node publishes to the job's other nodes."""

    SUCCEEDED = "succeeded"  # every rank exited 0
    FAILED = "failed"  # a rank failed (or the attempt could not start, or a node was lost)
    TIMED_OUT = "timed_out"  # a deadline passed: join, heartbeat, progress, wall time
    CANCELLED = "cancelled"  # asked by its owner or root
    DAEMON_STOPPING = "stopped"  # this daemon is stopping: the job goes back to the queue
    REFORMING = "restarting"  # a multi-node job's nodes re-form (a node joined or left)
    PREEMPTED = "preempted"  # stopped (gracefully: agreed step, checkpoint) for a job of higher priority


@dataclass
class Outcome:
    end: AttemptEnd
    reason: str
    root_cause: RootCause | None = None
    hang: bool = False  # dump stacks before teardown
    graceful: bool = False  # ask ranks to stop at a step boundary first


STOPS = frozenset({AttemptEnd.PREEMPTED, AttemptEnd.DAEMON_STOPPING, AttemptEnd.CANCELLED})


def settle_stop(concluded: Outcome, finished: Outcome | None, script: bool) -> Outcome:
    """A stop asked for (preemption, the daemon stopping, a cancel) while every rank was finishing its
    last step: a built-in task whose ranks all ended with their result, none stopped early (the
    caller passes `finished` only then), is SUCCEEDED, not requeued to run again nor called
    cancelled. A script's result does not say whether it stopped early, so its stop stands."""
    if concluded.end in STOPS and not script and finished is not None and finished.end is AttemptEnd.SUCCEEDED:
        return finished
    return concluded
