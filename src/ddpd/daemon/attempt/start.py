"""Starting an attempt's ranks and running each rank's tasks.

`Starter.launch` is the attempt's launch task: it starts local ranks 0..nproc-1 one after the
other (until the attempt concluded), each with `run_rank`, says `Launched`, and then, where local
rank 0 serves the attempt's store, tells it when every other local rank has exited (`Release`).
The ranks' tasks run inside it (a replacement's inside its re-form, `replace.reform`).

`run_rank` starts one rank (`launch.Launcher`, cold or from the warm pool) or the replacement of a
lost one (its log appended after a marker line), enters it into the gang and the job's ranks
before anything else is awaited, and writes its record and ``rank.spawned`` (the first rank: the
attempt's row, with its process group), all under `spawning`:
the teardown takes that lock before it begins and no start begins once the attempt concluded, so
a started process is always torn down with its attempt, and its ``rank.spawned`` comes before the
teardown's events (the launch runs beside the attempt's loop: a conclusion may come mid-start).
Then its starter is told (`task_status`), and its reader, exit watch and log keeping run, bound
to its job, attempt and rank in structlog's contextvars. A rank that cannot start reports
`StartFailed` (its starter is told None).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread
from structlog.contextvars import bound_contextvars

from ...protocol.channel import Release
from ...protocol.control import RootCause
from ...protocol.limits import clip_text
from ..config import Config
from ..contain.identity import Identity
from ..layout import rank_log_name, stderr_log
from ..ranklogs.keeper import LogKeeper, keep_logs
from ..ranklogs.workspace import create_logs, live_streams
from ..run.outcome import AttemptEnd, Outcome
from ..store.journal import Journal
from ..store.records import Job
from .events import Launched, StartFailed
from .gang import RankGang
from .launch import Launcher
from .ranks import RankHandle, RankLink, connected, read_frames, watch_exit


def _write_each(fds: tuple[int, int], data: bytes) -> None:
    for fd in fds:
        os.write(fd, data)


@dataclass(eq=False)
class Starter:
    """What starting an attempt's ranks needs, all known once its launcher exists."""

    config: Config
    journal: Journal
    job: Job
    number: int
    identity: Identity
    attempt_dir: Path
    launcher: Launcher
    gang: RankGang
    logs: LogKeeper
    link: RankLink
    concluded: anyio.Event  # the attempt concluded: no further rank starts
    token: str
    cgroup: str | None
    spawning: anyio.Lock = field(default_factory=anyio.Lock)  # held while a rank's process starts

    @property
    def offset(self) -> int:
        return self.launcher.offset

    async def launch(self) -> None:
        """Start every local rank in order (each rank's tasks run in here), then serve the store's release."""
        async with anyio.create_task_group() as ranks:
            for local in range(self.job.spec.nproc):
                if self.concluded.is_set():
                    break
                if await ranks.start(self.run_rank, local) is None:
                    break
            self.link.events.send_nowait(Launched())
            await self._release_store_host()

    async def run_rank(self, local: int, lost: RankHandle | None = None, *,
                       task_status: anyio.abc.TaskStatus[RankHandle | None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Start local rank `local` (or the replacement of `lost`), then run its tasks until they end."""
        h = await self._start(local, lost)
        task_status.started(h)
        if h is None:
            return
        job, link = self.job, self.link
        with bound_contextvars(job_id=job.id, attempt=self.number, rank=h.rank.rank):
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(watch_exit, h, link)
                    log_max = min(job.spec.log_max or self.config.rank_log_max, self.config.rank_log_max)
                    tg.start_soon(keep_logs, h, self.logs, log_max)
                    if h.hello is not None:  # a pooled rank said hello to the pool
                        await connected(h, h.hello, link)
                    await read_frames(h, link)
            finally:
                h.tasks_done.set()

    async def _start(self, local: int, lost: RankHandle | None) -> RankHandle | None:
        """Start the rank and record it; None when it cannot start (`StartFailed` said why) or the
        attempt concluded."""
        log_path = self.attempt_dir / rank_log_name(self.offset + local)
        # the teardown waits for a start under way, its record included (its rank.spawned comes before
        # the teardown's events, as when the teardown waited for the whole launch); none begins after
        async with self.spawning:
            if self.concluded.is_set():
                return None
            job = self.job
            # what the start logs (the pool's take: a fork, a wait for the key's server) names the rank
            with bound_contextvars(job_id=job.id, attempt=self.number, rank=self.offset + local):
                h = await self._spawn(local, lost, log_path)
            if h is None:
                return None
            await self.journal.save_rank(job, h.rank)
            told: dict[str, Any] = {"pooled": True} if h.pooled else {}
            if lost is not None:
                told["replaces"] = lost.proc.pid
            await self.journal.event(job, "rank.spawned", rank=h.rank.rank, pid=h.proc.pid, pgid=h.rank.pgid,
                                     log=str(log_path), **told)
            if h is self.gang.handles[0] and lost is None:  # the attempt's row names its process group
                port = self.launcher.rdzv.port
                await self.journal.save_attempt(job, self.number, pgid=self.gang.pgid, store_port=port,
                                                token=self.token, cgroup=self.cgroup)
            return h

    async def _spawn(self, local: int, lost: RankHandle | None, log_path: Path) -> RankHandle | None:
        """Start the process (its log appended after a marker line for a replacement) and give it its
        place in the gang and the job's ranks (taken over from `lost`) before anything else is awaited."""
        job, launcher = self.job, self.launcher
        r = self.offset + local
        try:
            fds = await anyio.to_thread.run_sync(create_logs, self.config.state_dir, self.identity, job.id,
                                                 self.number, r)
            try:
                if lost is not None:
                    marker = (f"ddpd: rank {r} (pid {lost.proc.pid}) was lost; its replacement (generation "
                              f"{launcher.generations.get(local, 0)}) writes from here\n").encode()
                    # the job's own files: written off the event loop, as every rank log is
                    await anyio.to_thread.run_sync(_write_each, fds, marker)
                    logs = lost.logs
                    lost.logs = None
                else:
                    logs = await anyio.to_thread.run_sync(
                        live_streams, self.config.state_dir, self.identity, job, self.number,
                        [str(log_path), stderr_log(str(log_path))], list(fds))
                try:
                    h = await launcher.start(local, log_path, fds)
                except BaseException:
                    if logs is not None:
                        logs.close()
                    raise
                h.logs = logs
            finally:
                for fd in fds:
                    os.close(fd)
        except OSError as exc:
            detail = clip_text(f"cannot start rank {r}: {exc}")
            self.link.events.send_nowait(StartFailed(Outcome(AttemptEnd.FAILED, "spawn_failed", RootCause(
                reason="spawn_failed", rank=r, attempt=self.number, detail=detail))))
            return None
        if lost is None:
            self.gang.add(h)
            job.ranks.append(h.rank)
        else:
            h.rank.replacements = lost.rank.replacements + 1
            self.gang.take_over(lost, h)
            job.ranks[job.ranks.index(lost.rank)] = h.rank
        return h

    async def _release_store_host(self) -> None:
        """Local rank 0 serves the store after its own result until every other local rank has exited."""
        handles = self.gang.handles
        if not self.launcher.rdzv.hosted or not handles or len(handles) != self.job.spec.nproc:
            return
        while waiting := [h for h in handles[1:] if not h.exited.is_set()]:  # replacements included
            await waiting[0].exited.wait()
        await handles[0].channel.send(Release())
