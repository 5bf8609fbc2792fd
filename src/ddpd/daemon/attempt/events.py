"""What an attempt's tasks report upward: typed events on one memory stream, read by `Attempt.run`.

Every task of an attempt (each rank's reader and exit watch, the launch, a replacement's re-form,
the node watch, the teardown) knows nothing of the attempt but the send side of this stream: it
says what happened and the attempt's one loop decides (`loop.Supervisor`), in a `match` over
`Event` that mypy proves exhaustive. Commands from outside (a cancel, a GPU fault, the daemon
stopping) set the attempt's conclusion at once and wake the loop with `Stopped`.

The stream is unbounded (`open_events`): a sender must never wait for the loop (a rank's reader
that waited would stop reading its channel, and a rank writing its result during the teardown
would block), and what it carries is bounded at its sources: a rank's events come from its
frames (within its frame budget, `ranks.FrameBudget`), every other task sends a handful.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ..run.outcome import Outcome

if TYPE_CHECKING:
    from .ranks import RankHandle
    from .replace import Reforming


@dataclass(frozen=True)
class Connected:
    """The rank said hello (to the attempt, or earlier to the pool) and was sent its assignment."""

    h: RankHandle


@dataclass(frozen=True)
class Joined:
    """The rank joined the process group (its state is written): the job may be running now."""

    h: RankHandle


@dataclass(frozen=True)
class Reformed:
    """Hot replacement: the rank trains again in the group of `generation`."""

    h: RankHandle
    generation: int


@dataclass(frozen=True)
class DeadlinesMoved:
    """A frame that starts or moves a deadline (a hello, a phase change, a failure): check them now."""


@dataclass(frozen=True)
class TimerFired:
    """The earliest pending deadline came (`loop.Timer`): check them now."""


@dataclass(frozen=True)
class ProtocolBroken:
    """The rank broke the channel's protocol (a flood, a bad or out-of-order frame): the attempt fails."""

    outcome: Outcome


@dataclass(frozen=True)
class Exited:
    """The rank exited; its exit, and the frames it sent before, are on its handle."""

    h: RankHandle


@dataclass(frozen=True)
class ExitRecorded:
    """The exit of a rank that succeeded is written: the attempt may have finished."""

    h: RankHandle


@dataclass(frozen=True)
class StartFailed:
    """A rank (or the attempt's directories) could not be started: the attempt fails so."""

    outcome: Outcome


@dataclass(frozen=True)
class Launched:
    """Every rank of the attempt was started: its deadlines are watched from now on."""


@dataclass(frozen=True)
class Replaced:
    """Hot replacement: every rank re-formed around the replacement of `r.lost`."""

    r: Reforming


@dataclass(frozen=True)
class ReplaceFailed:
    """Hot replacement: the re-form did not finish (`why`); the attempt fails with the lost rank."""

    r: Reforming
    why: str


@dataclass(frozen=True)
class NodeVerdict:
    """Multi-node: the node watch's verdict (another node failed or was lost, or nodes wait to join)."""

    outcome: Outcome


@dataclass(frozen=True)
class Stopped:
    """A command from outside concluded the attempt (a cancel, a GPU fault, the daemon stopping)."""


@dataclass(frozen=True)
class TornDown:
    """The teardown ended: no process of the attempt is left."""


Event = (Connected | Joined | Reformed | DeadlinesMoved | TimerFired | ProtocolBroken | Exited | ExitRecorded
         | StartFailed | Launched | Replaced | ReplaceFailed | NodeVerdict | Stopped | TornDown)

Events = MemoryObjectSendStream[Event]


def open_events() -> tuple[MemoryObjectSendStream[Event], MemoryObjectReceiveStream[Event]]:
    """The attempt's stream (unbounded: see the module docstring)."""
    return anyio.create_memory_object_stream[Event](math.inf)
