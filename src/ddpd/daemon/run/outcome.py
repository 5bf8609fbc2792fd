"""How an attempt ended: the job state it leads to, why, and what teardown must do first."""

from __future__ import annotations

from dataclasses import dataclass

from ...protocol import JobState
from ...protocol.control import RootCause


@dataclass
class Outcome:
    state: JobState
    reason: str
    root_cause: RootCause | None = None
    hang: bool = False  # dump stacks before teardown
    graceful: bool = False  # ask ranks to stop at a step boundary first
