"""One rank of an attempt: its handle, and its frames and exit turned into its state.

`read_frames` decodes the rank's channel and applies each frame (phase changes, heartbeats and
progress, checkpoints, the result or failure) with what the attempt gave it (`RankLink`), and
reports upward on the attempt's stream (`events`) what the attempt decides on: its hello and
assignment (`Connected`), its join, its re-form, a frame that moves a deadline, a broken protocol.
Everything a rank sends is bounded: a frame budget (`FrameBudget`, a token bucket of
``rank_frames_per_second`` with a one-second burst) for all frames, a smaller one for the frames
that are written to the journal (checkpoints, failures), and at most MAX_FAILURES failures. A rank
over a budget is failed with a protocol error naming it. The reader yields to the event loop every
YIELD_EVERY frames, so a flooding rank cannot starve the daemon.

A script that calls ``init_process_group`` again (destroy and re-init) sends its join phases
again: a re-join (`is_rejoin`), recorded as an event ``rank.rejoined`` with its count, while the
rank keeps its state. Re-joins and checkpoints are persisted within a per-rank budget, re-joins
coalesced, checkpoint paths clipped (`store.eventbudget`): a rank cannot grow the database without bound.

A Stacks frame answers an `AskStacks` the daemon sent (`RankHandle.asked`); an unasked or late
one is dropped.

`watch_exit` waits on the rank's pidfd and reports `Exited`: whether the attempt ends or replaces
the rank is the attempt's decision (`decide`). A rank succeeded when it exited 0 and (task mode)
sent its Result; a script rank needs only the clean exit (`rank_succeeded`).
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread

from ...protocol import FrameError, RankState, TransitionError
from ...protocol.channel import Assign, Checkpointed, Failure, Heartbeat, Hello, PhaseChanged, Progress, Result, Stacks
from ...protocol.control import RootCause
from ...protocol.limits import clip_text
from ...protocol.states import is_rejoin
from ..contain import procs
from ..pool.channel import WorkerChannel
from ..ranklogs.logindex import RankLogs
from ..run.clock import Clock
from ..run.outcome import AttemptEnd, Outcome
from ..run.rendezvous import Rendezvous, hand_over
from ..store.eventbudget import PATH_CLIP, EventBudget, rejoin_kept
from ..store.journal import Journal
from ..store.records import Job, Rank
from .deadlines import RankClock
from .events import Connected, DeadlinesMoved, Events, Exited, Joined, ProtocolBroken, Reformed

MAX_STEP = 2**63 - 1  # a step counter SQLite can store
YIELD_EVERY = 64  # frames read between two checkpoints of the event loop
JOURNALED_RATE = 100.0  # checkpoints and failures per second (each is a journal write)
JOURNALED_BURST = 1000.0
MAX_FAILURES = 4  # a rank reports one failure, then exits
RESULT_WAIT = 1.0  # after the exit: how long the frames it sent just before (its result) may take to be read
# ... and after a clean exit with no result read yet: the reader may be behind on journal writes that
# retry while the database is locked (each try waits the busy timeout), so wait out the journal's worst case
CLEAN_EXIT_RESULT_WAIT = 30.0
# refusals of hot replacement (replace.py) not worth saying in the exit event
NOT_ALLOWED = "the job allows no hot replacement"
STOPPING = "the daemon was stopping the attempt"


class FrameBudget:
    """A token bucket: `rate` frames a second on average, `burst` at once."""

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate, self.burst = rate, burst
        self.tokens = burst
        self.last = self.since = now
        self.count = 0

    def take(self, now: float) -> bool:
        self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
        self.last = now
        self.count += 1
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True


@dataclass(eq=False)
class StacksAsked:
    """An AskStacks sent to a rank, until its Stacks frame answers it."""

    answered: anyio.Event = field(default_factory=anyio.Event)
    reply: Stacks | None = None


@dataclass(eq=False)
class RankHandle:
    """A started rank, cold or adopted from the warm pool: the same handle either way."""

    rank: Rank
    proc: subprocess.Popen[bytes]
    channel: WorkerChannel
    pooled: bool = False  # a warm-pool worker: joins the group itself (Assign.pgid), verified from /proc
    hello: Hello | None = None  # a pooled rank's Hello, said to the pool before it was taken
    exited: anyio.Event = field(default_factory=anyio.Event)
    reader_done: anyio.Event = field(default_factory=anyio.Event)
    tasks_done: anyio.Event = field(default_factory=anyio.Event)  # its reader, exit watch and log keeping ended
    exit: procs.Exit | None = None
    result: Result | None = None
    failure: Failure | None = None
    failures: int = 0
    rejoins: int = 0  # init_process_group calls after the first (a script that destroys and re-inits)
    finished: bool = False  # it said its task or script returned (phase "done"): now on its way out
    ended_at_exit: bool = False  # stuck in its exit work after its result: ended by the daemon, result kept
    failed_at: float | None = None
    state_at_failure: str | None = None
    signals_before_exit: frozenset[str] = frozenset()
    last_progress_event: float = 0.0
    missed_reported: float | None = None
    asked: dict[int, StacksAsked] = field(default_factory=dict)  # AskStacks requests awaiting their answer
    logs: RankLogs | None = None  # the daemon's side of its stdout and stderr logs
    events: EventBudget = field(default_factory=EventBudget)  # what of its repeated events is persisted
    held_back: tuple[str, dict[str, Any]] | None = None  # the last event the budget kept live only

    def fail(self, now: float) -> None:
        """Record the first sign of failure (its time ranks root causes)."""
        if self.failed_at is None:
            self.failed_at = now
            self.state_at_failure = self.rank.state.value

    def clock_view(self) -> RankClock:
        r = self.rank
        return RankClock(rank=r.rank, state=r.state, last_frame=r.last_frame, last_step_change=r.last_step_change,
                         step=r.step, exited=self.exit is not None, missed_reported=self.missed_reported,
                         finished=self.finished, failed_at=self.failed_at if self.failure is not None else None,
                         has_result=self.result is not None, ending=self.ended_at_exit)

    def succeeded(self, script: bool) -> bool:
        """Its exit was clean (`rank_succeeded`), or it was ended stuck at exit after its result."""
        return rank_succeeded(self.exit, self.result, script) or (self.ended_at_exit and self.result is not None)


@dataclass(frozen=True)
class RankLink:
    """What a rank's tasks are given when the attempt starts them; their only way back is `events`."""

    job: Job
    journal: Journal
    number: int
    clock: Clock
    frame_rate: float
    events: Events
    signals: AbstractSet[str]  # the signals sent to the attempt's ranks so far (the gang's, as it grows)
    rdzv: Rendezvous
    assignment: Callable[[RankHandle], Assign]  # the launcher's: what the rank is sent after its hello


def rank_succeeded(exit_: procs.Exit | None, result: Result | None, script: bool) -> bool:
    """The daemon's own evidence: a clean exit, and (task mode) the rank's Result frame."""
    return exit_ is not None and exit_.ok and (script or result is not None)


def _stepped(rank: Rank, step: int, now: float) -> None:
    """A heartbeat's step counter: a new value restarts the progress clock."""
    if step != rank.step:
        rank.step = step
        rank.last_step_change = now


def heartbeat_applier(rank: Rank, clock: Clock, budget: FrameBudget) -> Callable[[object], bool]:
    """Apply a Heartbeat frame at once, in the channel's callback (memory only: no task wakes for it);
    anything else, or a heartbeat over the budget or out of range, is left to `read_frames` (False)."""

    def apply(msg: object) -> bool:
        if type(msg) is not Heartbeat or not 0 <= msg.step <= MAX_STEP:
            return False
        now = clock.monotonic()
        if not budget.take(now):
            return False  # read_frames takes it again, and fails the rank for the flood
        rank.last_frame = now
        _stepped(rank, msg.step, now)
        return True

    return apply


async def read_frames(h: RankHandle, ctx: RankLink) -> None:
    rank, job, clock = h.rank, ctx.job, ctx.clock
    budget = FrameBudget(ctx.frame_rate, ctx.frame_rate, clock.monotonic())
    journaled = FrameBudget(JOURNALED_RATE, JOURNALED_BURST, clock.monotonic())
    try:
        async for msg in h.channel.frames(quick=heartbeat_applier(rank, clock, budget)):
            now = clock.monotonic()
            rank.last_frame = now
            if budget.count % YIELD_EVERY == YIELD_EVERY - 1:
                await anyio.lowlevel.checkpoint()
            if not budget.take(now):
                raise FrameError("flood", f"rank {rank.rank} flooded its channel: {budget.count} frames in "
                                          f"{now - budget.since:.1f} s (limit {ctx.frame_rate:.0f}/s)")
            if isinstance(msg, Checkpointed | Failure) and not journaled.take(now):
                raise FrameError("flood", f"rank {rank.rank} sent {journaled.count} checkpoint/failure frames in "
                                          f"{now - journaled.since:.1f} s")
            if not 0 <= getattr(msg, "step", getattr(msg, "steps", 0)) <= MAX_STEP:
                # msgspec takes any 64-bit integer; SQLite stores signed ones, so a step of 2**64-1
                # would later fail a write (an internal error) instead of failing the rank now
                raise FrameError("bad_message", f"step out of range in {type(msg).__name__} frame")
            if not isinstance(msg, Heartbeat | Progress | Stacks):
                ctx.events.send_nowait(DeadlinesMoved())  # a hello or a phase change starts deadlines
            await _apply(h, ctx, msg, now)
        await _flush_held_back(h, ctx)
    except (FrameError, TransitionError) as exc:
        message = exc.message if isinstance(exc, FrameError) else f"out-of-order frame: {exc}"
        h.fail(clock.monotonic())
        await ctx.journal.event(job, "rank.protocol_error", rank=rank.rank, message=message)
        ctx.events.send_nowait(ProtocolBroken(Outcome(AttemptEnd.FAILED, "protocol_error", RootCause(
            reason="protocol_error", rank=rank.rank, attempt=ctx.number, phase=rank.state.value, detail=message))))
    finally:
        h.reader_done.set()


async def _apply(h: RankHandle, ctx: RankLink, msg: object, now: float) -> None:
    rank, job, journal = h.rank, ctx.job, ctx.journal
    match msg:
        case Heartbeat(step=step):
            _stepped(rank, step, now)
        case Progress(step=step, loss=loss):
            rank.step, rank.loss, rank.last_step_change = step, loss, now
            if rank.state is RankState.JOINED:
                await journal.rank_state(job, rank, RankState.TRAINING)
            if now - h.last_progress_event >= 0.2:
                h.last_progress_event = now
                await journal.event(job, "rank.progress", rank=rank.rank, persist=False, step=step, loss=loss)
        case Hello() as hello:
            await connected(h, hello, ctx)
        case Stacks(request=request) as stacks:
            if (asked := h.asked.get(request)) is not None and asked.reply is None:
                asked.reply = stacks
                asked.answered.set()
        case PhaseChanged(phase=("store_connected" | "joined") as phase) if is_rejoin(rank.state,
                                                                                      RankState(phase.upper())):
            if phase == "joined":  # a script's init_process_group again: tracked, the rank keeps its state
                h.rejoins += 1
                rank.last_step_change = now  # the rendezvous took its time: the progress clock starts over
                await _bounded(h, ctx, now, "rank.rejoined", rejoin_kept(h.rejoins), count=h.rejoins,
                               state=rank.state.value)
        case PhaseChanged(phase="store_connected"):
            if h.pooled:
                await check_pgid(h)
            await journal.rank_state(job, rank, RankState.STORE_CONNECTED, "rank.store_connected")
        case PhaseChanged(phase="joined"):
            rank.last_step_change = now
            await journal.rank_state(job, rank, RankState.JOINED, "rank.joined",
                                     seconds=round(now - rank.spawned_at, 3))
            ctx.events.send_nowait(Joined(h))
        case PhaseChanged(phase="training"):
            rank.last_step_change = now  # DDP is built: the progress clock starts over
            if rank.state is RankState.JOINED:
                await journal.rank_state(job, rank, RankState.TRAINING)
        case PhaseChanged(phase="reformed", generation=generation):  # hot replacement: it trains again in
            rank.last_step_change = now  # the group of `generation`
            if rank.state is RankState.JOINED:  # a replacement holds the group's state: it trains. Bug: it
                # counted as training only at its first report, and a loss before that was not replaced
                await journal.rank_state(job, rank, RankState.TRAINING)
            # its first step in the new group is an event at once (the rank reports it at once too):
            # the 0.2 s spacing dropped a survivor's, whose next report came a progress interval later
            h.last_progress_event = 0.0
            ctx.events.send_nowait(Reformed(h, generation))
        case PhaseChanged(phase="done"):
            h.finished = True  # a silence from now on is a stall at exit (deadlines, rootcause)
        case PhaseChanged():
            pass
        case Checkpointed(step=step, path=path):
            await _bounded(h, ctx, now, "job.checkpointed", True, step=step, path=clip_text(path, PATH_CLIP))
        case Result() as result:
            if h.result is not None:
                raise FrameError("bad_message", f"rank {rank.rank} sent a second result")
            h.result = result
            rank.step = result.steps
            rank.loss = result.loss if result.loss is not None else rank.loss
            rank.checksum = result.checksum
            await journal.event(job, "rank.result", rank=rank.rank, steps=result.steps, loss=result.loss,
                                checksum=result.checksum, stopped_early=result.stopped_early)
        case Failure() as failure:
            h.failures += 1
            if h.failures > MAX_FAILURES:
                raise FrameError("flood", f"rank {rank.rank} sent {h.failures} failure frames")
            if h.failure is None:
                h.failure = Failure(error=clip_text(failure.error, 1024), message=clip_text(failure.message),
                                    traceback=clip_text(failure.traceback), phase=clip_text(failure.phase, 256))
                h.fail(now)
                await journal.event(job, "rank.failed", rank=rank.rank, error=h.failure.error,
                                    message=h.failure.message, phase=h.failure.phase,
                                    traceback=h.failure.traceback)
            # not torn down yet: the rank runs its exit work and exits on its own first, as under
            # torchrun (its exit ends the attempt, `watch_exit`), within the kill grace (deadlines)
            ctx.events.send_nowait(DeadlinesMoved())


async def _bounded(h: RankHandle, ctx: RankLink, now: float, kind: str, wanted: bool, **data: Any) -> None:
    """An event the rank may cause again and again: persisted within its budget (`eventbudget`), else live only."""
    keep = wanted and h.events.admit(now)
    await ctx.journal.event(ctx.job, kind, rank=h.rank.rank, persist=keep, **data)
    if keep and h.held_back is not None and h.held_back[0] == kind:
        h.held_back = None
    if wanted and not keep:
        h.held_back = (kind, data)
        if h.events.first_refusal:
            await ctx.journal.event(ctx.job, "rank.events_limited", rank=h.rank.rank, of=kind,
                                    message=h.events.describe())


async def _flush_held_back(h: RankHandle, ctx: RankLink) -> None:
    """The last event the budget kept live only (the rank's last checkpoint, say) is persisted once its
    channel ends: the record's latest checkpoint is the rank's latest."""
    if h.held_back is not None:
        kind, data = h.held_back
        h.held_back = None
        await ctx.journal.event(ctx.job, kind, rank=h.rank.rank, held_back=True, **data)


async def connected(h: RankHandle, hello: Hello, ctx: RankLink) -> None:
    """The rank said hello (to the attempt, or earlier to the pool): record it, send the assignment.

    Every rank, pooled or cold, leads a session and a process group of its own (Assign.pgid 0:
    a pooled one stays where the pool started it), checked against /proc when a pooled one
    reports store_connected (`check_pgid`).
    """
    await ctx.journal.rank_state(ctx.job, h.rank, RankState.CONNECTED, "rank.connected",
                                 worker_pid=hello.pid, protocol=hello.version, torch=hello.torch, pooled=h.pooled)
    await hand_over(ctx.rdzv, h.channel, ctx.assignment(h))
    ctx.events.send_nowait(Connected(h))


async def check_pgid(h: RankHandle) -> None:
    """A pooled rank still leads its own process group (the one the gang signals): verify it."""
    info = await anyio.to_thread.run_sync(procs.proc_info, h.proc.pid)
    if info is not None and h.proc.returncode is None and info.pgid != h.rank.pgid:
        raise FrameError("pgid_mismatch", f"rank {h.rank.rank} (pid {h.proc.pid}) is in process group "
                                          f"{info.pgid}, not its own {h.rank.pgid}")


async def watch_exit(h: RankHandle, ctx: RankLink) -> None:
    """Wait for the rank's exit (its pidfd), record it on the handle and report it (`Exited`)."""
    exit_ = await procs.wait_exit(h.proc)
    h.signals_before_exit = frozenset(ctx.signals)
    if h.result is None and h.failure is None:  # the rank said how it ended: no wait for its channel's end
        with anyio.move_on_after(RESULT_WAIT):  # frames sent just before exiting (the result) are read first
            await h.reader_done.wait()
    if exit_.ok and h.result is None and not h.reader_done.is_set():
        with anyio.move_on_after(CLEAN_EXIT_RESULT_WAIT):
            await h.reader_done.wait()
    h.exit = exit_
    rank = h.rank
    rank.exit_code, rank.signal = exit_.code, exit_.signal
    if not h.succeeded(ctx.job.spec.script is not None):
        h.fail(ctx.clock.monotonic())
    h.exited.set()
    ctx.events.send_nowait(Exited(h))  # the attempt decides (it may replace the rank) and records the exit
