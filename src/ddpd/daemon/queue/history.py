"""Ended jobs leaving: `rm`, pruning past `retention`, and each user's history held to its bounds.

A job leaves with its rows (the journal) and its directory (logs, checkpoints); a StorageError keeps
everything as it was. Retiring (`retire`) takes a user's oldest ended jobs past
`max_history_per_user` / `max_history_bytes_per_user` (`retention.past_bounds`; never a job another
one waits for), at most RETIRE_BATCH per look: the retention task takes the rest.
"""

from __future__ import annotations

import shutil

import anyio
import anyio.to_thread
import msgspec
import structlog

from ...protocol import JobSpec
from ...protocol.spec import dependency_ids
from ..contain.usertree import remove_job_dir
from ..layout import legacy_job_dir
from ..run import lifecycle
from ..store.errors import NotRunnableError
from ..store.journal import Journal
from ..store.records import Job
from .live import LiveConfig
from .retention import Retention, beyond_bounds, past_bounds
from .table import JobTable

log = structlog.get_logger("ddpd")

MIB = 1024 * 1024
RETIRED_NAMED = 10  # retired jobs named in a submit's notice (the rest counted)
RETIRE_BATCH = 200  # one user's jobs retired per look (a submit waits for at most these)


class History:
    def __init__(self, live: LiveConfig, journal: Journal, table: JobTable, retention: Retention) -> None:
        self.live = live  # the daemon's current config (read at each use: a reload changes the bounds)
        self.journal = journal
        self.table = table
        self.retention = retention
        self._retiring = anyio.Lock()  # one user's history retired at a time (by the retention task or a submit)

    async def remove(self, job: Job, uid: int) -> None:
        """`rm`: forget an ended job (row, ranks, attempts, events, logs and checkpoints); owner or root."""
        job.check_owner(uid, "remove")
        refused = lifecycle.removal_refused(job.state)
        if refused is not None:
            raise NotRunnableError(f"job {job.id}: {refused}")
        await self.delete(job)
        await self.journal.event(None, "job.removed", removed=job.id, by_uid=uid)

    async def prune(self, job_id: str) -> None:
        """An ended job past `retention`: gone, with a ``job.pruned`` event."""
        job = await self.table.lookup(job_id)
        if job is not None:
            await self.delete(job)
            await self.journal.event(None, "job.pruned", pruned=job_id, finished_at=job.finished_at)

    async def delete(self, job: Job) -> bool:
        """A job's rows, then its directory (logs, checkpoints); StorageError keeps everything as it was.
        Whether its rows were there (False: removed meanwhile by another path)."""
        gone = await self.journal.delete_job(job.id)
        self.table.forget(job, deleted=gone)
        path = legacy_job_dir(self.live.current.state_dir, job.id)  # jobs from before the per-user tree
        await anyio.to_thread.run_sync(lambda: shutil.rmtree(path, ignore_errors=True))
        try:
            await anyio.to_thread.run_sync(remove_job_dir, self.live.current.state_dir, job.owner_uid, job.id)
        except OSError as exc:  # a symlink or a foreign directory planted on the way: left, reported
            log.warning("job.files_not_removed", job_id=job.id, error=str(exc))
        return gone

    def _bounded(self) -> bool:
        cfg = self.live.current
        return bool(cfg.max_history_per_user or cfg.max_history_bytes_per_user)

    async def retire(self, uid: int) -> list[str]:
        """Retire `uid`'s oldest ended jobs past its history bounds (`retention.past_bounds`), as `rm`
        does; their ids. The live `job.pruned` of each (reason `history`) and one `job.history_retired`
        on the user's newest ended job, which stays: nothing is recorded outside the user's own jobs."""
        if not self._bounded():
            return []
        cfg = self.live.current
        async with self._retiring:
            held = await self.journal.history_of(uid)
            awaited = {dep for j in self.table.unended.values() for dep in dependency_ids(j.spec)}
            retired: list[str] = []
            victims = past_bounds(held, cfg.max_history_per_user, cfg.max_history_bytes_per_user, awaited)
            if len(victims) > RETIRE_BATCH:  # (a bound lowered, an upgrade): the rest by the retention task
                victims = victims[:RETIRE_BATCH]
                self.retention.ended(uid)
            for job_id in victims:
                job = await self.table.lookup(job_id)
                if job is None or job.owner_uid != uid or not job.state.final or not await self.delete(job):
                    continue
                retired.append(job_id)
                await self.journal.event(None, "job.pruned", persist=False, pruned=job_id, reason="history")
        newest = await self.table.lookup(held[-1][0]) if retired else None
        if newest is not None:
            await self.journal.event(newest, "job.history_retired", owner_uid=uid, retired=retired[:100],
                                     count=len(retired), max_history_per_user=cfg.max_history_per_user,
                                     max_history_bytes_per_user=cfg.max_history_bytes_per_user)
        return retired

    async def notices(self, uid: int, spec: JobSpec) -> list[str]:
        """Before a new job of `uid` is saved: what is past its history bounds is retired now (a backlog
        the retention task has not reached: the bound holds at every submit), and the submitter is told
        when the end of this job will retire its oldest (its history with this job's spec is past a bound)."""
        if not self._bounded():
            return []
        cfg = self.live.current
        count, size = await self.journal.history_totals(uid)
        retired: list[str] = []
        if beyond_bounds(count, size, cfg.max_history_per_user, cfg.max_history_bytes_per_user):
            retired = await self.retire(uid)
            count, size = await self.journal.history_totals(uid)
        this = len(msgspec.json.encode(spec))  # the least its record will take
        if not retired and not beyond_bounds(count + 1, size + this, cfg.max_history_per_user,
                                             cfg.max_history_bytes_per_user):
            return []
        bounds = [f"max_history_per_user = {cfg.max_history_per_user}"] if cfg.max_history_per_user else []
        if cfg.max_history_bytes_per_user:
            bounds.append(f"max_history_bytes_per_user = {_size(cfg.max_history_bytes_per_user)}")
        text = (f"your history is at its bound: {count} ended jobs kept, {_size(size)} ({', '.join(bounds)}); "
                "as your jobs end, your oldest ended jobs are retired with their logs and checkpoints "
                "(`ddpctl rm` chooses which go first)")
        if retired:
            named = ", ".join(retired[:RETIRED_NAMED])
            more = f" and {len(retired) - RETIRED_NAMED} more" if len(retired) > RETIRED_NAMED else ""
            text += f"; retired now: {named}{more}"
        return [text]


def _size(n: int) -> str:
    return f"{n / MIB:.3g} MiB" if n >= MIB else f"{n / 1024:.3g} KiB"
