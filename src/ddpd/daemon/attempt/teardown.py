"""Teardown of an attempt: stop, dump, TERM and CONT, KILL, leftovers, against one deadline.

`escalate` is the decision, as pure logic over a `Gang` (the thing that signals and waits, as
trio's ``deliver_cancel``) and a `Clock`:

1. a hang: the ranks dump their stacks first (bounded by its own wait, information before force);
2. one deadline, `grace` from then on, shared by every step that follows;
3. a graceful outcome: the ranks are asked to stop at a step boundary, and get the deadline less
   the TERM share (half the grace, at most TERM_SHARE seconds);
4. SIGTERM and SIGCONT to the group (a stopped rank acts on TERM only once continued), waited on
   until the deadline;
5. SIGKILL, then at most UNKILLABLE_WAIT for the exits; ranks still there (D state) are reported
   as unkillable, never waited on for ever;
6. always: the leftover sweep (descendants in the group or carrying the attempt's marker).

So a cancel of ranks that ignore both the stop and SIGTERM takes one grace, not two.
`RankGang` (in gang.py) is the real Gang over an attempt's ranks.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Protocol

from ..run.clock import Clock

UNKILLABLE_WAIT = 5.0  # after SIGKILL: how long to wait before reporting a process as unkillable
TERM_SHARE = 1.0  # of a graceful teardown's grace, what SIGTERM gets at most (it gets half a short grace)


class Gang(Protocol):
    """The ranks of one attempt, as teardown sees them."""

    def alive(self) -> bool:
        """Any rank not yet seen exiting."""
        ...

    async def request_stop(self, grace: float) -> None:
        """Ask every live rank to stop at a step boundary (checkpoint, exit 0)."""
        ...

    async def dump_stacks(self) -> None:
        """Have every live rank dump its stacks into its log (bounded)."""
        ...

    async def signal(self, signum: signal.Signals, grace: float) -> None:
        """Signal every rank's process group (each rank leads its own; a rank not yet started is skipped)."""
        ...

    async def wait_exited(self, deadline: float) -> bool:
        """Wait until every rank has exited (True) or the clock reaches `deadline` (False)."""
        ...

    async def report_unkillable(self) -> None: ...

    async def sweep(self) -> None:
        """Kill and reap what is left: descendants of this attempt only."""
        ...


@dataclass
class Escalation:
    """What teardown did, and when (clock time): for the journal and for tests."""

    steps: list[tuple[str, float]] = field(default_factory=list)
    deadline: float | None = None

    def did(self, step: str, at: float) -> None:
        self.steps.append((step, at))

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.steps]


async def escalate(gang: Gang, clock: Clock, grace: float, *, graceful: bool, hang: bool) -> Escalation:
    done = Escalation()
    if gang.alive() and hang:
        done.did("dump", clock.monotonic())
        await gang.dump_stacks()
    deadline = done.deadline = clock.monotonic() + grace
    if gang.alive() and graceful:
        done.did("stop", clock.monotonic())
        await gang.request_stop(grace)
        await gang.wait_exited(deadline - min(grace / 2, TERM_SHARE))
    if gang.alive():
        done.did("TERM", clock.monotonic())
        await gang.signal(signal.SIGTERM, grace)
        await gang.signal(signal.SIGCONT, grace)
        if not await gang.wait_exited(deadline):
            done.did("KILL", clock.monotonic())
            await gang.signal(signal.SIGKILL, grace)
            if not await gang.wait_exited(clock.monotonic() + UNKILLABLE_WAIT):
                done.did("unkillable", clock.monotonic())
                await gang.report_unkillable()
    done.did("sweep", clock.monotonic())
    await gang.sweep()
    return done
