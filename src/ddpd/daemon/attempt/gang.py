"""The ranks of one attempt as one gang: signals to their groups, stack dumps, and the leftover sweep.

Each rank leads a session and a process group of its own (as torchrun's workers do: under autogroup
scheduling a session is one CPU scheduling group, and ranks sharing one trained a small model about
a fifth slower), so a signal to the gang is one `killpg` per rank whose pid is still ours (not yet
reaped: its group id cannot have been reused); what a reaped rank left in its group is found by the
sweep (its group, its marker) and by the cgroup kill.

`RankGang` is the real `teardown.Gang`. Everything a job can touch is read off the event loop:
rank logs through ``files`` (non-blocking, no symlinks, regular files only, bounded waits) and
/proc scans in a worker thread. The sweep kills what is left of this attempt (in its group, or
escaped with setsid but carrying its marker) and reaps only those pids: never another attempt's
child or the pool's.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import anyio
import anyio.to_thread

from ...protocol.channel import DumpStacks, Stop
from ..contain import procs
from ..contain.cgroups import Cgroup
from ..contain.files import JobFileError, Opener, job_file_size, read_job_file
from ..contain.reaper import disown
from ..layout import stderr_log
from ..run.clock import Clock, wait_until
from ..run.rootcause import StackSite, locate
from ..store.journal import Journal
from ..store.records import Job
from .ranks import RankHandle
from .teardown import UNKILLABLE_WAIT

STACK_DUMP_WAIT = 1.0
# what a rank left behind that ends on its own once the rank is gone (multiprocessing's resource
# tracker sees its pipe close) gets this long before it counts as left and is killed
LEFTOVER_GRACE = 1.0
DUMP_READ_LIMIT = 1 << 20  # bytes of a rank log read for its stack dump


class RankGang:
    def __init__(self, job: Job, journal: Journal, clock: Clock, marker: bytes, start_ticks: int,
                 opener: Opener | None = None) -> None:
        self.job, self.journal, self.clock = job, journal, clock
        self.opener = opener  # opens a rank log safely in its owner's tree
        self.cgroup: Cgroup | None = None  # the attempt's cgroup, where there is one
        self.marker = marker  # DDPD_ATTEMPT=... as in /proc/PID/environ
        self.start_ticks = start_ticks
        self.handles: list[RankHandle] = []
        self.pgid: int | None = None  # the first rank's (the attempt row's, events' and restarts' reference)
        self.signals_sent: set[str] = set()
        self.stack_sites: dict[int, StackSite] = {}  # rank -> where its main thread hung (from its dump)
        self.reason = ""
        self.stop_signal = 0  # raised in a script's ranks that handle it when they are asked to stop

    def contain_in(self, cgroup: Cgroup) -> None:
        """The attempt's cgroup, once made: teardown kills what is left in it."""
        self.cgroup = cgroup

    def add(self, h: RankHandle) -> bool:
        """A started rank joins the gang; True for the first, whose process group the attempt names."""
        first = self.pgid is None
        if first:
            self.pgid = h.rank.pgid
        self.handles.append(h)
        return first

    def take_over(self, lost: RankHandle, new: RankHandle) -> None:
        """A replacement takes the lost rank's place (hot replacement); the lost one has exited."""
        self.handles[self.handles.index(lost)] = new

    def live(self) -> list[RankHandle]:
        return [h for h in self.handles if not h.exited.is_set()]

    def alive(self) -> bool:
        return bool(self.live())

    def pgids(self) -> set[int]:
        return {h.rank.pgid for h in self.handles if h.rank.pgid is not None}

    def signal_now(self, signum: signal.Signals) -> None:
        self.signals_sent.add(signum.name)
        for h in self.handles:
            if h.proc.returncode is None and h.rank.pgid is not None:  # not reaped: the group is still its
                procs.kill_group(h.rank.pgid, signum)

    async def signal(self, signum: signal.Signals, grace: float) -> None:
        if signum is signal.SIGTERM:
            await self.journal.event(self.job, "job.teardown", signal="SIGTERM", grace=grace, pgid=self.pgid,
                                     reason=self.reason)
        elif signum is signal.SIGKILL:
            await self.journal.event(self.job, "job.teardown", signal="SIGKILL", pgid=self.pgid,
                                     ranks=[h.rank.rank for h in self.live()])
        self.signal_now(signum)

    async def request_stop(self, grace: float) -> None:
        for h in self.live():
            await h.channel.send(Stop(reason=self.reason, signal=self.stop_signal))
        signalled: dict[str, Any] = {"signal": signal.Signals(self.stop_signal).name} if self.stop_signal else {}
        await self.journal.event(self.job, "job.stop_requested", reason=self.reason, grace=grace, **signalled)

    async def wait_exited(self, deadline: float) -> bool:
        async def all_exited() -> None:
            for h in self.handles:
                await h.exited.wait()

        return await wait_until(self.clock, deadline, all_exited)

    async def report_unkillable(self) -> None:
        for h in self.live():
            info = await anyio.to_thread.run_sync(procs.proc_info, h.proc.pid)
            await self.journal.event(self.job, "rank.unkillable", rank=h.rank.rank, pid=h.proc.pid,
                                     proc_state=info.state if info else "?")
            disown(h.proc.pid)  # no one waits for it any more: reaped whenever it dies

    # -- stack dumps -----------------------------------------------------------------------

    async def _tail(self, h: RankHandle, start: int) -> str:
        if h.rank.log is None:
            return ""
        try:
            data = await read_job_file(stderr_log(h.rank.log), start, DUMP_READ_LIMIT, opener=self.opener)
        except (OSError, JobFileError):  # a FIFO, a symlink, a slow file: no dump to read
            return ""
        return data.decode("utf-8", "replace")

    async def _size(self, h: RankHandle) -> int:
        return 0 if h.rank.log is None else await job_file_size(stderr_log(h.rank.log), opener=self.opener)

    async def _await_dumps(self, handles: list[RankHandle], sizes: dict[int, int]) -> None:
        """Bounded: faulthandler answers nothing, so watch the logs until each holds a whole
        main-thread stack (a dump is written line by line)."""
        deadline = self.clock.monotonic() + STACK_DUMP_WAIT
        while self.clock.monotonic() < deadline:
            for h in handles:
                if h.rank.rank not in self.stack_sites:
                    site = locate(h.rank.rank, await self._tail(h, sizes[h.rank.rank]), h.finished)
                    if site is not None:
                        self.stack_sites[h.rank.rank] = site
            if all(h.rank.rank in self.stack_sites for h in handles):
                return
            await anyio.sleep(0.02)

    async def dump_stacks(self, only: list[RankHandle] | None = None) -> None:
        """Every live rank's stacks into its log (`only`: those ranks'), and where each main thread is."""
        live = self.live() if only is None else [h for h in only if h in self.live()]
        sizes = {h.rank.rank: await self._size(h) for h in live}
        for h in live:  # faulthandler's C handler: answers even while a C call holds the GIL
            try:
                os.kill(h.proc.pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        await self._await_dumps(live, sizes)
        # then the reader thread, for ranks whose SIGUSR1 did not dump (a script may take SIGUSR1);
        # one after the other, so that two dumps never interleave in one log
        late = [h for h in live if h.rank.rank not in self.stack_sites]
        for h in late:
            await h.channel.send(DumpStacks())
        await self._await_dumps(late, sizes)
        dumped = [h.rank.rank for h in live if await self._size(h) > sizes[h.rank.rank]]
        for h in live:
            h.rank.stack_dump = h.rank.rank in dumped
            await self.journal.save_rank(self.job, h.rank)
        await self.journal.event(self.job, "job.stacks_dumped", ranks=dumped,
                                 logs={str(h.rank.rank): stderr_log(h.rank.log or "") for h in live},
                                 where={str(r): site.describe() for r, site in sorted(self.stack_sites.items())})

    # -- leftovers -------------------------------------------------------------------------

    def _descendants(self, ranks: set[int]) -> list[procs.ProcInfo]:
        """Blocking (a /proc scan, at teardown only): this attempt's processes (zombies too), not
        counting its ranks: those in its group or carrying its marker. Only a process started since
        the attempt began can be one (the marker is new with each attempt, and a pid of its group
        reused by an older process is not), so no older process's environment is ever read."""
        found: list[procs.ProcInfo] = []
        me, groups = os.getpid(), self.pgids()
        for pid in procs.all_pids():
            if pid == me or pid in ranks:
                continue
            info = procs.proc_info(pid)
            if info is None or info.start_time < self.start_ticks:
                continue
            if info.pgid in groups or procs.proc_environ_has(pid, self.marker):
                found.append(info)
        return found

    async def _kill_cgroup(self, cg: Cgroup, ranks: set[int]) -> None:
        """cgroup.kill: SIGKILL to all that is left in the attempt's cgroup, whatever setsid or double
        fork it did; then reap those that became our children, and remove the cgroup."""
        try:
            pids = await anyio.to_thread.run_sync(cg.pids)
            emptied = await anyio.to_thread.run_sync(cg.kill, UNKILLABLE_WAIT)
        except OSError as exc:
            await self.journal.event(self.job, "job.cgroup_error", cgroup=str(cg.path), error=str(exc))
            return
        others = [pid for pid in pids if pid not in ranks]
        if others:
            await self.journal.event(self.job, "job.leftover_killed", pids=others, via="cgroup")
        if not emptied:
            left = await anyio.to_thread.run_sync(cg.pids)
            await self.journal.event(self.job, "rank.unkillable", pids=left, cgroup=str(cg.path))
            return
        with anyio.move_on_after(UNKILLABLE_WAIT):
            for pid in others:
                await procs.wait_gone(pid)
        await anyio.to_thread.run_sync(procs.reap_children, others)
        try:
            await anyio.to_thread.run_sync(cg.remove)
        except OSError as exc:
            await self.journal.event(self.job, "job.cgroup_error", cgroup=str(cg.path), error=str(exc))

    async def _settle(self, ranks: set[int]) -> None:
        """Give what the ranks left (in the cgroup, or in their groups) LEFTOVER_GRACE to end on its
        own, as it does under python and torchrun: a helper that exits when its parent's pipe closes
        is not a leftover."""
        if self.cgroup is not None:
            try:
                pids = await anyio.to_thread.run_sync(self.cgroup.pids)
            except OSError:
                return
        else:
            pids = [p.pid for p in await anyio.to_thread.run_sync(self._descendants, ranks) if p.state != "Z"]
        others = [pid for pid in pids if pid not in ranks]
        if others:
            with anyio.move_on_after(LEFTOVER_GRACE):
                for pid in others:
                    await procs.wait_gone(pid)

    async def sweep(self) -> None:
        ranks = {h.proc.pid for h in self.handles}
        await self._settle(ranks)
        if self.cgroup is not None:
            await self._kill_cgroup(self.cgroup, ranks)
        found = await anyio.to_thread.run_sync(self._descendants, ranks)
        leftovers = [p for p in found if p.state != "Z"]
        for p in leftovers:
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if leftovers:
            with anyio.move_on_after(UNKILLABLE_WAIT):
                for p in leftovers:
                    await procs.wait_gone(p.pid)
            await self.journal.event(self.job, "job.leftover_killed", pids=[p.pid for p in leftovers])
        # those that became our zombies (we are a subreaper): only this attempt's pids, never a rank
        # (its Popen reaps it) nor another attempt's or the pool's child
        await anyio.to_thread.run_sync(procs.reap_children, {p.pid for p in found})
