"""The journal's reads of the state database: jobs (with their latest attempt's ranks), their
attempts, one user's history, fair-share usage, curves and recorded events.

`StoredJobs` only reads; `Journal` (store.journal) adds the writes and the event stream on top of it.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from ...protocol import JobState
from ...protocol.control import EventView
from .records import Job, Rank
from .rows import job_from_row, rank_from_row
from .state import StateDB

FINAL = "(" + ", ".join(f"'{s.value}'" for s in JobState if s.final) + ")"  # SQL: the final states


class StoredJobs:
    """What the database holds, read off the event loop (`StateDB.run`)."""

    def __init__(self, db: StateDB) -> None:
        self.db = db

    async def load_curve(self, job_id: str) -> str | None:
        """A job's stored curve (JSON), None when it has none."""
        rows = await self.db.run(lambda c: c.execute("SELECT data FROM curves WHERE job_id = ?", (job_id,)).fetchall())
        return str(rows[0]["data"]) if rows else None

    async def load_jobs(self, recent_ended: int | None = None) -> list[Job]:
        """Jobs by seq, with their latest attempt's ranks: every job, or the unended ones and the most
        recent `recent_ended` ended ones (the rest stays on disk: `load_job`, `list_jobs_page`)."""
        sql = "SELECT * FROM jobs ORDER BY seq"
        if recent_ended is not None:
            sql = (f"SELECT * FROM jobs WHERE state NOT IN {FINAL} UNION ALL "
                   f"SELECT * FROM (SELECT * FROM jobs WHERE state IN {FINAL} ORDER BY seq DESC LIMIT ?) "
                   "ORDER BY seq")
        rows = await self.db.run(lambda c: c.execute(sql, () if recent_ended is None else (recent_ended,)).fetchall())
        return await self._with_ranks([job_from_row(r) for r in rows])

    async def load_job(self, job_id: str) -> Job | None:
        rows = await self.db.run(lambda c: c.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchall())
        return (await self._with_ranks([job_from_row(rows[0])]))[0] if rows else None

    async def list_jobs_page(self, limit: int, before: int | None = None, *, owner_uid: int | None = None,
                             active: bool = False) -> list[Job]:
        """Up to `limit` jobs with seq below `before`, newest first; one owner's, or only unended ones."""
        sql, params = "SELECT * FROM jobs WHERE seq < ?", [before if before is not None else 2**63 - 1]
        if owner_uid is not None:
            sql += " AND owner_uid = ?"
            params.append(owner_uid)
        if active:
            sql += f" AND state NOT IN {FINAL}"
        rows = await self.db.run(lambda c: c.execute(sql + " ORDER BY seq DESC LIMIT ?", (*params, limit)).fetchall())
        return await self._with_ranks([job_from_row(r) for r in rows])

    async def ids_with_prefix(self, prefix: str, limit: int) -> list[str]:
        """Up to `limit` job ids that start with `prefix` (a range on the primary key), oldest first."""
        if not prefix:
            return []
        upper = prefix[:-1] + chr(min(ord(prefix[-1]) + 1, 0x10FFFF))
        rows = await self.db.run(lambda c: c.execute(
            "SELECT id FROM jobs WHERE id >= ? AND id < ? ORDER BY seq LIMIT ?", (prefix, upper, limit)).fetchall())
        return [str(r["id"]) for r in rows]

    async def job_by_key(self, owner_uid: int, key: str) -> str | None:
        rows = await self.db.run(lambda c: c.execute(
            "SELECT id FROM jobs WHERE owner_uid = ? AND idempotency_key = ?", (owner_uid, key)).fetchall())
        return str(rows[0]["id"]) if rows else None

    async def ended_counts(self) -> dict[JobState, int]:
        rows = await self.db.run(lambda c: c.execute(
            f"SELECT state, count(*) AS n FROM jobs WHERE state IN {FINAL} GROUP BY state").fetchall())
        return {JobState(r["state"]): int(r["n"]) for r in rows}

    async def load_usage(self) -> dict[int, tuple[float, float, float]]:
        """Every user's saved fair-share usage: uid -> (GPU-seconds, CPU-slot-seconds, as of)."""
        rows = await self.db.run(lambda c: c.execute("SELECT uid, gpu_seconds, cpu_seconds, at FROM usage").fetchall())
        return {int(r["uid"]): (float(r["gpu_seconds"]), float(r["cpu_seconds"]), float(r["at"])) for r in rows}

    async def oldest_ended(self) -> float | None:
        rows = await self.db.run(lambda c: c.execute(
            f"SELECT min(finished_at) AS t FROM jobs WHERE state IN {FINAL}").fetchall())
        return None if rows[0]["t"] is None else float(rows[0]["t"])

    async def ended_before(self, cutoff: float, limit: int) -> list[str]:
        """Ids of ended jobs that finished before `cutoff`, oldest first."""
        rows = await self.db.run(lambda c: c.execute(
            f"SELECT id FROM jobs WHERE state IN {FINAL} AND finished_at < ? ORDER BY finished_at LIMIT ?",
            (cutoff, limit)).fetchall())
        return [str(r["id"]) for r in rows]

    async def history_totals(self, owner_uid: int) -> tuple[int, int]:
        """One user's ended jobs on record: how many, and the bytes their records take."""
        rows = await self.db.run(lambda c: c.execute(
            f"SELECT count(*) AS n, total(coalesce(stored_bytes, length(CAST(spec AS BLOB)))) AS b FROM jobs "
            f"WHERE owner_uid = ? AND finished_at IS NOT NULL AND state IN {FINAL}", (owner_uid,)).fetchall())
        return int(rows[0]["n"]), int(rows[0]["b"])

    async def history_of(self, owner_uid: int) -> list[tuple[str, int]]:
        """One user's ended jobs, oldest first: (id, the bytes its record takes)."""
        rows = await self.db.run(lambda c: c.execute(
            "SELECT id, coalesce(stored_bytes, length(CAST(spec AS BLOB))) AS b FROM jobs "
            f"WHERE owner_uid = ? AND finished_at IS NOT NULL AND state IN {FINAL} ORDER BY finished_at, seq",
            (owner_uid,)).fetchall())
        return [(str(r["id"]), int(r["b"])) for r in rows]

    async def _with_ranks(self, jobs: list[Job]) -> list[Job]:
        """Fill each job's ranks of its latest attempt, in one query."""
        if not jobs:
            return jobs
        ids = json.dumps([j.id for j in jobs])
        rows = await self.db.run(lambda c: c.execute(
            "SELECT r.* FROM ranks r JOIN jobs j ON r.job_id = j.id AND r.attempt = j.attempt "
            "WHERE r.job_id IN (SELECT value FROM json_each(?)) ORDER BY r.job_id, r.rank", (ids,)).fetchall())
        by_job: dict[str, list[Rank]] = {}
        for r in rows:
            by_job.setdefault(r["job_id"], []).append(rank_from_row(r))
        for job in jobs:
            job.ranks = by_job.get(job.id, [])
        return jobs

    async def attempt_ranks(self, job_id: str, attempt: int) -> list[int]:
        """The global ranks an attempt started on this daemon, in order."""
        rows = await self.db.run(lambda c: c.execute(
            "SELECT rank FROM ranks WHERE job_id = ? AND attempt = ? ORDER BY rank", (job_id, attempt)).fetchall())
        return [int(r["rank"]) for r in rows]

    async def attempt_tokens(self, job_id: str, attempt: int) -> list[str]:
        """The marker tokens recorded for an attempt (its processes carry DDPD_ATTEMPT=job:attempt:token)."""
        rows = await self.db.run(lambda c: c.execute(
            "SELECT token FROM attempts WHERE job_id = ? AND attempt = ?", (job_id, attempt)).fetchall())
        return [str(r["token"]) for r in rows]

    async def attempt_cgroups(self, job_id: str, attempt: int) -> list[str]:
        """The cgroups recorded for an attempt (killed whole at recovery, before the marker sweep)."""
        rows = await self.db.run(lambda c: c.execute(
            "SELECT cgroup FROM attempts WHERE job_id = ? AND attempt = ? AND cgroup IS NOT NULL",
            (job_id, attempt)).fetchall())
        return [str(r["cgroup"]) for r in rows]

    async def list_events(self, job_id: str | None, since: int, limit: int) -> list[EventView]:
        """Up to `limit` recorded events after `since` (seq), oldest first; one job's or all."""
        sql = "SELECT * FROM events WHERE seq > ?"
        params: tuple[Any, ...] = (since,)
        if job_id is not None:
            sql += " AND job_id = ?"
            params += (job_id,)
        rows = await self.db.run(lambda c: c.execute(sql + " ORDER BY seq LIMIT ?", (*params, limit)).fetchall())
        return [EventView(seq=r["seq"], ts=r["ts"], kind=r["kind"], job_id=r["job_id"], attempt=r["attempt"],
                          rank=r["rank"], data=msgspec.json.decode(r["data"])) for r in rows]
