"""The hooks of a multi-node attempt: its node watch, and the root cause it settles on at the end.

`watch_nodes` runs beside the attempt's ranks: it polls the rendezvous store (`NodeSession.poll`)
every interval and returns the outcome of a verdict, which the attempt's loop concludes on
(`NodeVerdict`): another node's written failure, a lost node, the
store unreachable (FAILED, torn down at once), or nodes waiting to join an elastic job (RESTARTING,
graceful: the ranks checkpoint and stop, and the job re-forms without counting a restart).

`settle` runs after the teardown: a failure of this node's own (a rank that died or failed on its
own) is written into the store for the others, as "node N (host H) failed: ..."; a failure that
only shows peers gone (collateral errors, no cause) waits, at most keep-alive and an interval, for
the verdict that names the node that went first. A node whose attempt was cancelled, ran out of
wall time or whose daemon stops says so too, so that the others do not wait for its silence.
"""

from __future__ import annotations

import anyio
import msgspec

from ...protocol.channel import Failure
from ...protocol.control import RootCause
from ..run.clock import Clock
from ..run.outcome import AttemptEnd, Outcome
from ..run.rootcause import is_collateral
from .nodes import NodeSession
from .nodewatch import Verdict

NODE_REASONS = frozenset({"node_lost", "node_failed", "node_unreachable", "membership_change"})


def verdict_outcome(session: NodeSession, verdict: Verdict, number: int) -> Outcome:
    text = session.describe(verdict)
    if verdict.kind == "waiting":
        return Outcome(AttemptEnd.REFORMING, "membership_change", RootCause(reason="membership_change",
                                                                           attempt=number, detail=text), graceful=True)
    reason = {"failed": "node_failed", "lost": "node_lost"}.get(verdict.kind, "node_unreachable")
    return Outcome(AttemptEnd.FAILED, reason, RootCause(reason=reason, attempt=number, detail=text))


async def watch_nodes(session: NodeSession, number: int, clock: Clock) -> Outcome:
    """Publish this node's attempt as running, then poll until a verdict ends it: how it ends."""
    await session.publish("running")
    while True:
        verdict = await session.poll(clock.monotonic())
        if verdict is not None:
            session.mark(verdict)
            if verdict.kind == "waiting":
                session.membership_changes += 1
            return verdict_outcome(session, verdict, number)
        await anyio.sleep(session.interval)


def own_fault(cause: RootCause | None) -> bool:
    """A root cause of this node's own: not merely a rank that saw its peers go."""
    if cause is None or cause.reason in NODE_REASONS:
        return False
    return cause.error is None or not is_collateral(Failure(error=cause.error, message=cause.message or "",
                                                            traceback="", phase=""))


async def settle(session: NodeSession, outcome: Outcome, number: int, clock: Clock) -> Outcome:
    """The attempt's outcome as the job's other nodes should know it (see the module docstring)."""
    layout = session.layout
    if layout is None:
        return outcome
    if outcome.end in (AttemptEnd.SUCCEEDED, AttemptEnd.REFORMING):
        await session.publish(outcome.end.value)
        return outcome
    if outcome.end is not AttemptEnd.FAILED:  # cancelled, out of wall time, its daemon stopping
        why = "its daemon is stopping" if outcome.end is AttemptEnd.DAEMON_STOPPING else outcome.reason
        await session.publish(outcome.end.value, failure=f"node {layout.node_rank} (host {session.address}) "
                                                         f"{outcome.end.value}: {why}")
        return outcome
    if outcome.reason in NODE_REASONS:
        await session.publish("failed")
        return outcome
    if not own_fault(outcome.root_cause):
        deadline = clock.monotonic() + session.keep_alive + session.interval
        while clock.monotonic() < deadline:
            verdict = await session.poll(clock.monotonic())
            if verdict is not None and verdict.kind != "waiting":
                session.mark(verdict)
                await session.publish("failed")
                return verdict_outcome(session, verdict, number)
            await anyio.sleep(session.interval)
    cause = outcome.root_cause
    host = session.address
    text = f"node {layout.node_rank} (host {host}) failed: {cause.detail if cause is not None else outcome.reason}"
    await session.publish("failed", failure=text)
    if cause is not None:
        outcome.root_cause = msgspec.structs.replace(cause, detail=text)
    return outcome
