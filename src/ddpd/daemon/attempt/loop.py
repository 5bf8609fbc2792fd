"""The attempt's one decision loop: every event of its tasks, read in order and decided in one `match`.

`Supervisor.run` reads the attempt's stream (`events`) until the teardown ended; it alone changes
the attempt's decisions (its conclusion, the replacement under way, the stop warning) and starts
tasks into the attempt's task group: each exit's record and a replacement's re-form after it
(`replace.reform`), the ending of ranks stuck at exit, the stop warning's frames and the missed
heartbeats' events (what may wait on a rank, or is written once per rank, runs beside the loop,
which must stay free to decide; it awaits only the job's few own writes: running, replaced, replace
failed), the node watch, the deadline timer and the teardown. The first conclusion
wins (the rest is collateral); once there is one, the teardown starts, and the loop goes on
deciding (each exit is still recorded) until the teardown says `TornDown`.

Deadlines (`deadlines.check`) are watched once every rank was started (`Launched`): checked when
a frame may have moved one (`DeadlinesMoved`) and when the timer fires (`TimerFired`, at the
earliest pending deadline, but not sooner than TIMER_GRAIN after a check: every heartbeat moves
its rank's deadlines, so the earliest one comes due, and has moved, ranks times a second).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import assert_never

import anyio
import anyio.abc
from anyio.streams.memory import MemoryObjectReceiveStream

from ...protocol import RankState
from ...protocol.channel import Stop
from ..contain import procs
from ..multinode.multinode import watch_nodes
from ..multinode.nodes import NodeSession
from ..run import lifecycle
from ..run.clock import Clock, wait_until
from ..run.outcome import AttemptEnd, Outcome
from ..store.journal import Journal
from ..store.records import Job
from .deadlines import Limits, Watch, check
from .decide import exit_conclusion, exit_told, finished_outcome
from .events import (
    Connected,
    DeadlinesMoved,
    Event,
    Events,
    Exited,
    ExitRecorded,
    Joined,
    Launched,
    NodeVerdict,
    ProtocolBroken,
    Reformed,
    Replaced,
    ReplaceFailed,
    StartFailed,
    Stopped,
    TimerFired,
    TornDown,
)
from .gang import RankGang
from .ranks import RankHandle
from .replace import Reforming, Replacements, reform
from .start import Starter
from .teardown import escalate

TIMER_GRAIN = 0.25  # seconds: a deadline is met within this (the timer sleeps as long, unless a frame replans)
CHECK_EVERY = 64  # events decided at most between two deadline checks that are due (a flood cannot starve them)


@dataclass(eq=False)
class Timer:
    """Fires `TimerFired` at `at` (set by the loop after each check; None: nothing pending)."""

    clock: Clock
    events: Events
    at: float | None = None
    moved: anyio.Event | None = None

    def set(self, at: float | None) -> None:
        self.at = at
        if self.moved is not None:
            self.moved.set()

    async def run(self) -> None:
        while True:
            moved = self.moved = anyio.Event()
            if self.at is None:
                await moved.wait()
            elif not await wait_until(self.clock, self.at, moved.wait):
                self.at = None
                self.events.send_nowait(TimerFired())


class Supervisor:
    """An attempt's decisions: its conclusion, its deadlines, its ranks' exits and replacements."""

    def __init__(self, job: Job, journal: Journal, number: int, clock: Clock, limits: Limits, gang: RankGang, *,
                 heartbeat_interval: float, kill_grace: float, nodes: NodeSession | None) -> None:
        self.job, self.journal, self.number, self.clock = job, journal, number, clock
        self.limits, self.gang, self.nodes = limits, gang, nodes
        self.heartbeat_interval, self.kill_grace = heartbeat_interval, kill_grace
        self.outcome: Outcome | None = None
        self.concluded = anyio.Event()
        self.warned = False  # the ranks were asked to stop before the wall-time limit
        self.started = clock.monotonic()
        self.started_wall = clock.time()
        self.replacements = Replacements(job, store_host_rank=None)
        self.torn_down = False
        self._watching = False  # every rank was started: the deadlines are watched
        self._due = False  # a deadline may have appeared, moved earlier or come: check them
        self._tearing = False

    def conclude(self, outcome: Outcome) -> None:
        """The first conclusion wins; later ones (collateral) are ignored."""
        if self.outcome is None:
            self.outcome = outcome
            self.concluded.set()

    def exit_outcome(self) -> Outcome | None:
        return finished_outcome(self.gang.handles, self.job.spec.nproc, self.job.spec.script is not None, self.number,
                                cancel_requested=self.job.cancel_requested, warned=self.warned,
                                stop_warning_lead=self.limits.stop_warning_lead, wall=self.limits.wall)

    async def run(self, tg: anyio.abc.TaskGroup, events: Events, receive: MemoryObjectReceiveStream[Event],
                  starter: Starter | None) -> None:
        """Decide on every event until the teardown ended (`TornDown`)."""
        self.events = events
        self._timer = Timer(self.clock, events)
        tg.start_soon(self._timer.run)
        since_check = 0
        while True:
            if self.outcome is not None and not self._tearing:
                self._tearing = True
                tg.start_soon(self._teardown_task, starter)
            idle = receive.statistics().current_buffer_used == 0
            if self._due and self.outcome is None and (idle or since_check >= CHECK_EVERY):
                since_check = 0
                await self._check(tg)
                continue
            event = await receive.receive()
            since_check += 1
            if isinstance(event, TornDown):
                return
            await self._decide(event, tg, starter)

    async def _decide(self, event: Event, tg: anyio.abc.TaskGroup, starter: Starter | None) -> None:
        now = self.clock.monotonic()
        match event:
            case DeadlinesMoved() | TimerFired():
                self._due = self._watching and self.outcome is None
            case Connected(h=h):
                self.replacements.connected(h, now)
            case Joined():
                await self._joined()
            case Reformed(h=h, generation=generation):
                self.replacements.on_reformed(h, now, self.job.spec.nproc, generation)
            case ProtocolBroken(outcome=ended) | StartFailed(outcome=ended) | NodeVerdict(outcome=ended):
                self.conclude(ended)
            case Exited(h=h):
                self._exited(h, tg, starter)
            case ExitRecorded():
                if (outcome := self.exit_outcome()) is not None:
                    self.conclude(outcome)
            case Launched():
                self._watching = self._due = self.outcome is None
                if self.nodes is not None:
                    tg.start_soon(self._watch_nodes, self.nodes)
            case Replaced(r=r):
                await self._replaced(r)
            case ReplaceFailed(r=r, why=why):
                await self.journal.event(self.job, "rank.replace_failed", rank=r.lost.rank.rank,
                                         generation=r.generation, reason=why)
                self.conclude(Outcome(AttemptEnd.FAILED, "rank_failed"))
            case Stopped() | TornDown():
                pass
            case _:
                assert_never(event)

    # -- the ranks -------------------------------------------------------------------------

    async def _joined(self) -> None:
        job = self.job
        joined = sum(r.state in (RankState.JOINED, RankState.TRAINING) for r in job.ranks)
        new = lifecycle.when_joined(job.state, joined, job.spec.nproc)
        reported = any(h.failure is not None for h in self.gang.handles)
        if new is not None and not reported:  # a failed rank is not running (causal order)
            await self.journal.job_state(job, new, "all ranks joined")

    def _exited(self, h: RankHandle, tg: anyio.abc.TaskGroup, starter: Starter | None) -> None:
        """A rank exited: the attempt ends, or the rank is replaced in place (replace.py: decided at once,
        and the replacement starts once the lost rank's exit is recorded), or it succeeded."""
        ok = h.succeeded(self.job.spec.script is not None)
        refusal = None
        if not ok:
            concluded = self.outcome is not None or h.failure is not None or starter is None
            refusal = self.replacements.refusal(h, concluded=concluded, signalled=bool(self.gang.signals_sent))
            if refusal is None:
                self.replacements.begin(h, self.clock.monotonic())
        if (outcome := exit_conclusion(h, ok, refusal, self.number)) is not None:
            self.conclude(outcome)  # decided before the journal write: teardown starts at once
        tg.start_soon(self._record_exit, h, ok, refusal, starter)

    async def _record_exit(self, h: RankHandle, ok: bool, refusal: str | None, starter: Starter | None) -> None:
        rank, exit_ = h.rank, h.exit
        assert exit_ is not None
        await self.journal.rank_state(self.job, rank, RankState.EXITED, "rank.exited", exit_code=exit_.code,
                                      signal=exit_.signal, **exit_told(ok, refusal))
        if ok:
            self.events.send_nowait(ExitRecorded(h))
        elif refusal is None:
            r = self.replacements.under_way
            assert r is not None and r.lost is h and starter is not None
            await reform(r, starter)

    async def _replaced(self, r: Reforming) -> None:
        lost, new = r.lost, r.replacement
        self.replacements.under_way = None
        assert new is not None and r.ready_at is not None and r.joined_at is not None
        await self.journal.event(self.job, "rank.replaced", rank=lost.rank.rank, pid=new.proc.pid,
                                 lost_pid=lost.proc.pid, generation=r.generation, pooled=new.pooled,
                                 step=new.rank.step, ready=round(r.ready_at - r.noticed, 3),
                                 reformed=round(r.joined_at - r.noticed, 3),
                                 seconds=round(self.clock.monotonic() - r.noticed, 3),
                                 replacements=new.rank.replacements)

    async def _watch_nodes(self, session: NodeSession) -> None:
        self.events.send_nowait(NodeVerdict(await watch_nodes(session, self.number, self.clock)))

    # -- deadlines -------------------------------------------------------------------------

    def _watch(self) -> Watch:
        wall_at = None
        if self.limits.wall is not None and self.job.started_at is not None:  # counted from the first start
            wall_at = self.started + self.limits.wall - (self.started_wall - self.job.started_at)
        return Watch(number=self.number, started=self.started, nproc=self.job.spec.nproc,
                     script=self.job.spec.script is not None, wall_at=wall_at, warned=self.warned)

    async def _check(self, tg: anyio.abc.TaskGroup) -> None:
        """What is due now: a conclusion, missed heartbeats, ranks stuck at exit, the stop warning; then
        the timer is set to the earliest deadline (re-checked then: a heartbeat may have moved it later).
        Bug: a 4 s progress timeout used to wait for the 120 s join deadline the timer had gone to sleep
        on; a frame that starts a deadline now checks them at once (`DeadlinesMoved`)."""
        self._due = False
        now = self.clock.monotonic()
        watch = self._watch()
        handles = self.gang.handles
        verdict = check(self.limits, watch, [h.clock_view() for h in handles], now)
        if verdict.outcome is not None:
            self.conclude(verdict.outcome)
            return
        if verdict.missed:
            missed = [h for h in handles if h.rank.rank in verdict.missed]
            for h in missed:
                h.missed_reported = h.rank.last_frame
            tg.start_soon(self._report_missed, [(h.rank.rank, round(now - (h.rank.last_frame or now), 3),
                                                 h.rank.state.value) for h in missed])
        if verdict.stuck:
            stuck = [h for h in handles if h.rank.rank in verdict.stuck]
            for h in stuck:
                h.ended_at_exit = True
            tg.start_soon(self._end_stuck, stuck, now)
            self._due = True
            return
        if verdict.warn:
            self.warned = True  # decided now; the frames go out in a task (a rank that reads nothing waits)
            tg.start_soon(self._warn_stop, now, watch.wall_at or now)
            self._due = True
            return
        self._timer.set(max(now + TIMER_GRAIN, verdict.next_at if verdict.next_at is not None else now + 1.0))

    async def _report_missed(self, missed: list[tuple[int, float, str]]) -> None:
        """Ranks silent past MISSED_HEARTBEATS intervals, once per silence: (rank, seconds, state) as checked."""
        for rank, silent, state in missed:
            await self.journal.event(self.job, "rank.heartbeat_missed", rank=rank, silent=silent,
                                     interval=self.heartbeat_interval, timeout=self.limits.heartbeat, state=state)

    async def _end_stuck(self, stuck: list[RankHandle], now: float) -> None:
        """Ranks that sent their result and then fell silent in their exit work (a native call holding
        the GIL): where each is (its stacks), then it alone is killed; its result stands."""
        await self.gang.dump_stacks(only=stuck)
        for h in stuck:
            site = self.gang.stack_sites.get(h.rank.rank)
            silent = now - (h.rank.last_frame or now)
            where = f" in {site.innermost}" if site is not None else ""
            await self.journal.event(
                self.job, "rank.stuck_at_exit", rank=h.rank.rank, seconds=round(silent, 1),
                where=site.describe() if site is not None else None,
                message=f"rank {h.rank.rank} finished its {'script' if self.job.spec.script else 'task'} and "
                        f"was stuck at exit{where} for {silent:.0f} s; ended (its result is kept)")
            if h.proc.returncode is None and h.rank.pgid is not None:
                procs.kill_group(h.rank.pgid, signal.SIGKILL)

    async def _warn_stop(self, now: float, wall_at: float) -> None:
        """Before the wall-time limit (as Slurm's --signal): every rank is asked to stop at a step
        boundary and checkpoint. Ranks that then exit 0 end the job TIMED_OUT (wall_time) at once;
        ranks that do not stop are torn down when the wall time runs out."""
        for h in self.gang.live():
            await h.channel.send(Stop(reason="wall_time_warning"))
        await self.journal.event(self.job, "job.stop_warning", reason="wall_time_warning",
                                 seconds_left=round(wall_at - now, 3), wall=self.limits.wall)

    # -- teardown --------------------------------------------------------------------------

    async def _teardown_task(self, starter: Starter | None) -> None:
        await self.teardown(starter)
        self.events.send_nowait(TornDown())

    async def teardown(self, starter: Starter | None) -> None:
        """Stop, dump, TERM, KILL and sweep (`teardown.escalate`), shielded: no process of the attempt is
        left. A rank start under way ends first (its process joins the gang); none begins after."""
        assert self.outcome is not None
        outcome = self.outcome
        self.gang.reason = outcome.reason
        with anyio.CancelScope(shield=True):
            if starter is not None:
                async with starter.spawning:
                    pass
            t0 = self.clock.monotonic()
            await escalate(self.gang, self.clock, self.kill_grace, graceful=outcome.graceful, hang=outcome.hang)
            await self.journal.event(self.job, "job.torn_down", seconds=round(self.clock.monotonic() - t0, 3),
                                     reason=outcome.reason)
        self.torn_down = True

