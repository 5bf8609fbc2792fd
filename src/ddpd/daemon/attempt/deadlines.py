"""The attempt's deadlines, as pure logic: timeouts, rank states and `now` -> what is due, and when next.

`check` reads no clock and has no side effects; the attempt calls it with its clock's `now` and
sleeps until `Verdict.next_at` (or until a frame may have moved a deadline). Deadlines, all in the
attempt's monotonic time:

- join: every rank JOINED (or further) within `join` seconds of the attempt's start; the ranks
  furthest behind are named (`join_timeout`);
- heartbeat: a live rank that sent no frame at all for `heartbeat` seconds (`heartbeat_timeout`;
  a rank that had said its task or script returned is named as stuck at exit); a rank that had
  also sent its result is stuck in its exit work, not in the job's: it alone is ended
  (`Verdict.stuck`) and its result kept;
  after MISSED_HEARTBEATS intervals of silence it is reported once (`Verdict.missed`);
- progress: a rank's step counter frozen for `progress` seconds once it trains (the built-in loop
  from JOINED on, with at least `join` between joining and the first step) (`progress_timeout`);
- wall: the job's wall time, counted from its first start, with a stop warning `stop_warning`
  seconds before (never more than half the wall time) (`Verdict.warn`, then `wall_time`);
- a failed rank's exit: a rank that reported its failure (its Failure frame) runs its exit work
  and exits on its own, as under torchrun, before the others are torn down; it has `failed_exit`
  seconds (the kill grace) for that, then the attempt ends anyway (`rank_failed`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...protocol import RankState
from ...protocol.control import RootCause
from ..run.outcome import AttemptEnd, Outcome

MISSED_HEARTBEATS = 2  # a rank silent for more than this many intervals is reported (heartbeat_missed)


@dataclass(frozen=True)
class Limits:
    join: float
    heartbeat: float
    progress: float
    heartbeat_interval: float
    wall: float | None = None
    stop_warning: float = 0.0
    failed_exit: float = 5.0

    @property
    def stop_warning_lead(self) -> float:
        """How long before the wall-time limit the ranks are asked to stop: `stop_warning`, but never
        more than half the wall time (a daemon default of 30 s must not stop a 20 s job at its start)."""
        return 0.0 if self.wall is None else min(self.stop_warning, self.wall / 2)


@dataclass(frozen=True)
class RankClock:
    """What the deadlines need to know of one rank."""

    rank: int
    state: RankState
    last_frame: float | None = None
    last_step_change: float | None = None
    step: int = 0
    exited: bool = False
    missed_reported: float | None = None  # the last_frame whose silence was already reported
    finished: bool = False  # it said its task or script returned (phase "done")
    failed_at: float | None = None  # when it reported its failure (a Failure frame)
    has_result: bool = False  # it sent its Result frame
    ending: bool = False  # being ended at its exit (`Verdict.stuck`) already


@dataclass(frozen=True)
class Watch:
    """What the deadlines need to know of the attempt."""

    number: int
    started: float  # when the attempt started
    nproc: int
    script: bool  # a script reports no steps until it calls `report`
    wall_at: float | None = None  # when the wall time runs out; None: no wall time
    warned: bool = False  # the stop warning was sent


@dataclass(frozen=True)
class Verdict:
    outcome: Outcome | None = None  # a deadline has passed: the attempt ends so
    next_at: float | None = None  # else: the earliest pending deadline
    missed: tuple[int, ...] = ()  # ranks to report as heartbeat_missed now
    warn: bool = False  # send the stop warning now
    stuck: tuple[int, ...] = ()  # ranks stuck in their exit work after their result: end them, keep it


def check(limits: Limits, watch: Watch, ranks: list[RankClock], now: float) -> Verdict:
    """What is due at `now`: an outcome, or the missed heartbeats, the warning and the next deadline."""
    deadlines: list[float] = []
    live = [r for r in ranks if not r.exited]
    joined = (RankState.JOINED, RankState.TRAINING, RankState.EXITED)
    pending = [r for r in live if r.state not in joined]
    if pending or len(ranks) < watch.nproc:
        at = watch.started + limits.join
        if now >= at:
            return Verdict(join_timeout(limits, watch, ranks, pending))
        deadlines.append(at)
    stuck: list[int] = []
    for r in live:
        if r.last_frame is not None and not r.ending:
            at = r.last_frame + limits.heartbeat
            if now >= at and r.finished and r.has_result:
                stuck.append(r.rank)
                continue
            if now >= at:
                return Verdict(Outcome(AttemptEnd.TIMED_OUT, "heartbeat_timeout", RootCause(
                    reason="heartbeat_timeout", attempt=watch.number, rank=r.rank, phase=r.state.value,
                    detail=_silent(r, watch, now - r.last_frame)), hang=True))
            deadlines.append(at)
    for r in live:
        if r.failed_at is not None:
            at = r.failed_at + limits.failed_exit
            if now >= at:
                return Verdict(Outcome(AttemptEnd.FAILED, "rank_failed"))
            deadlines.append(at)
    if (outcome := _progress(limits, watch, live, now, deadlines)) is not None:
        return Verdict(outcome)
    if watch.wall_at is not None:
        if now >= watch.wall_at:
            return Verdict(Outcome(AttemptEnd.TIMED_OUT, "wall_time", RootCause(
                reason="wall_time", attempt=watch.number, detail=f"wall time of {limits.wall:.0f}s reached")))
        deadlines.append(watch.wall_at)
    late = MISSED_HEARTBEATS * limits.heartbeat_interval
    missed: list[int] = []
    for r in live:
        if r.last_frame is None or r.missed_reported == r.last_frame:
            continue
        if now >= r.last_frame + late:
            missed.append(r.rank)
        else:
            deadlines.append(r.last_frame + late)
    warn = False
    if watch.wall_at is not None and not watch.warned:
        warn_at = watch.wall_at - limits.stop_warning_lead
        warn = now >= warn_at
        if not warn:
            deadlines.append(warn_at)
    return Verdict(None, min(deadlines) if deadlines else None, tuple(missed), warn, tuple(stuck))


def _silent(r: RankClock, watch: Watch, seconds: float) -> str:
    if r.finished:
        work = "script" if watch.script else "task"
        return f"rank {r.rank} finished its {work}, then sent nothing for {seconds:.1f}s (stuck at exit)"
    return f"rank {r.rank} sent nothing for {seconds:.1f}s"


def _progress(limits: Limits, watch: Watch, live: list[RankClock], now: float,
              deadlines: list[float]) -> Outcome | None:
    watched = (RankState.TRAINING,) if watch.script else (RankState.JOINED, RankState.TRAINING)
    # a finished rank takes no more steps (rank 0 may still serve the store for its peers)
    stalled = [r for r in live if r.state in watched and r.last_step_change is not None and not r.finished]
    if not stalled:
        return None

    def limit(r: RankClock) -> float:
        # between joining and the first step a rank sets up (optimizer, checkpoint, DDP): under
        # load that outlasts a short progress timeout, so it gets at least the join timeout
        return limits.progress if r.state is RankState.TRAINING else max(limits.progress, limits.join)

    at = min((r.last_step_change or 0.0) + limit(r) for r in stalled)
    if now < at:
        deadlines.append(at)
        return None
    low = min(r.step for r in stalled)
    overdue = [r for r in stalled if (r.last_step_change or 0.0) + limit(r) <= now]
    # progress arrives coalesced (and through heartbeats), so a peer frozen at the same step may be
    # seen to freeze a little later: it is a suspect too, and the stack dumps tell which one hung
    frozen_at = min(r.step for r in overdue)
    overdue += [r for r in stalled if r.step == frozen_at and r not in overdue]
    stuck = [r.rank for r in overdue]
    return Outcome(AttemptEnd.TIMED_OUT, "progress_timeout", RootCause(
        reason="progress_timeout", attempt=watch.number, ranks=stuck, rank=stuck[0], phase=overdue[0].state.value,
        detail=f"step counter of rank(s) {stuck} frozen at {low} for {limit(overdue[0]):.0f}s"), hang=True)


def join_timeout(limits: Limits, watch: Watch, ranks: list[RankClock], pending: list[RankClock]) -> Outcome:
    """Name the ranks furthest behind; ranks already in init_process_group are only waiting for them."""
    missing = watch.nproc - len(ranks)
    behind = min((r.state.order for r in pending), default=0)
    culprits = [r for r in pending if r.state.order == behind]
    parts = [f"rank {r.rank} never joined (reached {r.state.value})" for r in culprits]
    parts += [f"rank {r.rank} waiting in init_process_group ({r.state.value})" for r in pending if r not in culprits]
    if missing:
        parts.append(f"{missing} rank(s) never spawned")
    named = [r.rank for r in culprits]
    return Outcome(AttemptEnd.TIMED_OUT, "join_timeout", RootCause(
        reason="join_timeout", attempt=watch.number, ranks=named, rank=named[0] if named else None,
        phase=culprits[0].state.value if culprits else None,
        detail=f"join timeout after {limits.join:.0f}s: " + "; ".join(parts)), hang=True)
