"""Hot rank replacement, the daemon's side: whether a lost rank is replaced in place, and the re-form.

A rank of a built-in task's attempt that dies while training (a signal, a non-zero exit) is
replaced when the job allows it (`spec.hot_replacements`, counted over the job) and none of the
refusals below holds; then the survivors keep running: each is sent a `Reform` naming the next
generation, a replacement starts with the dead rank's number, log (appended, after a marker line),
devices and cgroup (from the warm pool when it has one, else cold), and every rank joins the
generation's group and takes rank 0's state (`worker.reform`). `Replacements` is the attempt's
record of it, changed by the attempt's loop alone (the replacement's `Connected`, each rank's
`Reformed`); `reform` is the task the loop starts for one replacement: it waits READY_WAIT for
the replacement to connect and REFORM_WAIT for every rank to say it re-formed, and reports
`Replaced`, or `ReplaceFailed` past either bound. Then, or when the replacement dies first, the
attempt fails with the lost rank as its root cause, and the job restarts from its checkpoint if
`max_restarts` allows.

Refused (the attempt fails as before): the job allows none or has used them; the daemon stopped the
rank (a timeout, a cancel, a teardown); rank 0 (it serves the attempt's store); a rank not yet
training (nothing to keep); a rank that finished its work; a second loss while a re-form is under
way (more than one rank at once); a rank whose Python failure repeats one a replacement already
redid (the same error and message twice).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import anyio

from ...protocol import RankState
from ...protocol.channel import Reform
from ...protocol.spec import hot_replacements
from ..store.records import Job
from .events import Replaced, ReplaceFailed
from .ranks import NOT_ALLOWED, STOPPING, RankHandle
from .start import Starter

READY_WAIT = 5.0  # seconds for the replacement to connect (pooled: at once; cold: an interpreter start)
REFORM_WAIT = 10.0  # seconds for every rank to re-form once the replacement connected
LOGS_WAIT = 2.0  # seconds for the lost rank's tasks (its log's last look) to end


@dataclass(eq=False)
class Reforming:
    """One replacement under way: the lost rank, its generation, and what has happened since."""

    lost: RankHandle
    generation: int
    noticed: float  # monotonic: when the daemon saw the exit
    ready: anyio.Event = field(default_factory=anyio.Event)  # the replacement connected
    done: anyio.Event = field(default_factory=anyio.Event)  # every rank re-formed
    reformed: set[int] = field(default_factory=set)
    ready_at: float | None = None
    joined_at: float | None = None
    replacement: RankHandle | None = None


@dataclass
class Replacements:
    """An attempt's replacements: the current generation, the one under way, the failures redone."""

    job: Job
    store_host_rank: int | None  # the rank serving the attempt's store (never replaced), if any
    generation: int = 0
    under_way: Reforming | None = None
    redone: set[tuple[str, str]] = field(default_factory=set)  # (error, message) of failures replaced once
    lost: list[RankHandle] = field(default_factory=list)  # every handle replaced (root-cause evidence)

    def refusal(self, h: RankHandle, *, concluded: bool, signalled: bool) -> str | None:
        """Why the lost rank `h` is not replaced; None: it is."""
        allowed = hot_replacements(self.job.spec)
        if allowed == 0:
            return NOT_ALLOWED
        if self.job.hot_replaced >= allowed:
            return f"the job's {allowed} hot replacement(s) are used"
        if concluded or signalled or self.job.cancel_requested:
            return STOPPING
        if h.rank.rank == self.store_host_rank:
            return f"rank {h.rank.rank} serves the attempt's store"
        if h.finished or h.result is not None:
            return "the rank had finished its work"
        if h.rank.state is not RankState.TRAINING:
            return f"the rank was lost before training ({h.rank.state.value})"
        if self.under_way is not None:
            return f"rank {self.under_way.lost.rank.rank} was still being replaced (more than one rank lost at once)"
        if h.failure is not None and (h.failure.error, h.failure.message) in self.redone:
            return f"the replacement would repeat the same failure ({h.failure.error}: {h.failure.message})"
        return None

    def begin(self, h: RankHandle, now: float) -> Reforming:
        """Reserve the replacement of `h` (the refusal was None)."""
        self.generation += 1
        self.job.hot_replaced += 1
        if h.failure is not None:
            self.redone.add((h.failure.error, h.failure.message))
        self.lost.append(h)
        self.under_way = Reforming(lost=h, generation=self.generation, noticed=now)
        return self.under_way

    def connected(self, h: RankHandle, now: float) -> None:
        """Rank `h` connected: the replacement under way, when it has the lost rank's number."""
        r = self.under_way
        if r is not None and h is not r.lost and h.rank.rank == r.lost.rank.rank and not r.ready.is_set():
            r.replacement = h
            r.ready_at = now
            r.ready.set()

    def on_reformed(self, h: RankHandle, now: float, nproc: int, generation: int) -> None:
        """Rank `h` re-formed (the replacement: took the state; a survivor: joined and took it) in the
        group of `generation`: across nodes, one another node's daemon began (the next is after it)."""
        self.generation = max(self.generation, generation)
        r = self.under_way
        if r is None:
            return
        r.reformed.add(h.rank.rank)
        if len(r.reformed) >= nproc and not r.done.is_set():
            r.joined_at = now
            r.done.set()


async def reform(r: Reforming, starter: Starter) -> None:
    """Replace `r.lost` in place: tell the survivors, start the replacement (its tasks run in this
    one's), and report, once every rank re-formed (`Replaced`) or past a bound (`ReplaceFailed`)."""
    job, lost, journal = starter.job, r.lost, starter.journal
    rank = lost.rank.rank
    await journal.event(job, "rank.lost", rank=rank, pid=lost.proc.pid, exit_code=lost.rank.exit_code,
                        signal=lost.rank.signal, step=lost.rank.step, generation=r.generation,
                        replacements_left=hot_replacements(job.spec) - job.hot_replaced)
    for h in starter.gang.live():
        await h.channel.send(Reform(generation=r.generation))
    with anyio.move_on_after(LOGS_WAIT):  # its log's last look is done before the replacement writes
        await lost.tasks_done.wait()
    local = rank - starter.offset
    starter.launcher.generations[local] = r.generation
    async with anyio.create_task_group() as tg:
        if await tg.start(starter.run_rank, local, lost) is None:
            return  # it could not start: the attempt fails naming why (StartFailed)
        starter.link.events.send_nowait(await _wait_reform(r, starter.offset, job.spec.nproc))


async def _wait_reform(r: Reforming, offset: int, nproc: int) -> Replaced | ReplaceFailed:
    """Bounded: the replacement connects within READY_WAIT, then every rank re-forms within REFORM_WAIT."""
    with anyio.move_on_after(READY_WAIT) as waited:
        await r.ready.wait()
    if waited.cancelled_caught:
        return ReplaceFailed(r, f"no replacement for rank {r.lost.rank.rank} connected within {READY_WAIT:g}s")
    with anyio.move_on_after(REFORM_WAIT) as waited:
        await r.done.wait()
    if waited.cancelled_caught:
        missing = sorted(set(range(offset, offset + nproc)) - r.reformed)
        return ReplaceFailed(r, f"ranks {missing} did not re-form within {REFORM_WAIT:g}s")
    return Replaced(r)
