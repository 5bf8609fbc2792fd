"""How an attempt ended: the job state it leads to, why, and what teardown must do first."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from ...protocol import JobState
from ...protocol.control import RootCause
from ...protocol.limits import clip_text


@dataclass
class Outcome:
    state: JobState
    reason: str
    root_cause: RootCause | None = None
    hang: bool = False  # dump stacks before teardown
    graceful: bool = False  # ask ranks to stop at a step boundary first


def bounded(cause: RootCause) -> RootCause:
    """`cause` with its texts clipped to TEXT_LIMIT (head and tail): it is stored and shown in every
    status reply; the whole text stays in the rank log."""
    return msgspec.structs.replace(
        cause,
        detail=None if cause.detail is None else clip_text(cause.detail),
        message=None if cause.message is None else clip_text(cause.message),
        traceback=None if cause.traceback is None else clip_text(cause.traceback),
    )
