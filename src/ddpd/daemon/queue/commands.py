"""What a job's runner is told and what it reports: typed commands in, typed ends out.

A `JobRunner` (queue.runner) takes these on its command stream and is the only writer of its job's
state (besides the journal, which records it). The scheduler sends `Preempt`; a cancel of a started
job, the daemon's stop and the GPU quarantine send the others. A command to a runner that has ended
is dropped (its job has nothing left to stop). `RunEnd` is how the runner's `run` returns.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Cancel:
    """Stop the job for good (`ddpctl cancel`, or an idle-GPU cancel): gracefully, or killed at once."""

    reason: str
    force: bool


@dataclass(frozen=True)
class GpuFault:
    """A GPU the job holds was quarantined: the attempt fails with `detail` as its root cause."""

    detail: str


@dataclass(frozen=True)
class Stop:
    """The daemon stops: the job goes back to the queue at a step boundary, or killed at once (`force`)."""

    force: bool


@dataclass(frozen=True)
class Preempt:
    """Stop attempt number `attempt` at an agreed step, checkpointed, for the queued job `by`; a
    Preempt for an attempt that has already ended is ignored (a restart may be preempted anew)."""

    attempt: int
    by: str
    by_uid: int
    by_priority: int


Command = Cancel | GpuFault | Stop | Preempt


@dataclass(frozen=True)
class Ended:
    """The job reached its final state."""


@dataclass(frozen=True)
class Requeued:
    """The job is back in the queue: preempted, the daemon stopping, or a restart off a quarantined GPU."""

    reason: str


RunEnd = Ended | Requeued
