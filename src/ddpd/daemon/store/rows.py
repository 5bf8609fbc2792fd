"""The state database's rows and the records they hold: a job's and a rank's row each way, and an upsert.

A stored value that no longer passes the current bounds (a row written before they existed) is read as
something recovery can go on with: a spec that cannot be read fails its job (`spec_unreadable`)
instead of running what was not submitted, and an unreadable node table is empty.
"""

from __future__ import annotations

import sqlite3
from typing import Any

import msgspec

from ...protocol import JobSpec, JobState, RankState
from ...protocol.control import RootCause
from ...protocol.limits import clip_text
from ...protocol.nodes import NodeView
from .records import Job, Rank


def upsert(conn: sqlite3.Connection, table: str, key: tuple[str, ...], row: dict[str, Any]) -> None:
    cols = ", ".join(row)
    marks = ", ".join(f":{c}" for c in row)
    updates = ", ".join(f"{c}=excluded.{c}" for c in row if c not in key)
    conn.execute(f"INSERT INTO {table} ({cols}) VALUES ({marks}) ON CONFLICT({', '.join(key)}) DO UPDATE SET {updates}",
                 row)


def job_row(job: Job) -> dict[str, Any]:
    return {
        "id": job.id, "seq": job.seq, "name": job.name, "owner_uid": job.owner_uid,
        "spec": msgspec.json.encode(job.spec).decode(), "state": job.state.value, "attempt": job.attempt,
        "priority": job.spec.priority, "submitted_at": job.submitted_at, "started_at": job.started_at,
        "finished_at": job.finished_at, "reason": job.reason,
        "root_cause": None if job.root_cause is None else msgspec.json.encode(job.root_cause).decode(),
        "idempotency_key": job.idempotency_key,
        "nodes": msgspec.json.encode(job.nodes).decode() if job.nodes else None,
    }


def rank_row(job_id: str, rank: Rank) -> dict[str, Any]:
    return {
        "job_id": job_id, "attempt": rank.attempt, "rank": rank.rank, "state": rank.state.value, "pid": rank.pid,
        "pgid": rank.pgid, "step": rank.step, "loss": rank.loss, "exit_code": rank.exit_code,
        "signal": rank.signal, "checksum": rank.checksum, "log": rank.log, "stack_dump": int(rank.stack_dump),
        "replacements": rank.replacements,
    }


def _stored_spec(raw: str) -> tuple[JobSpec, str | None]:
    """The stored spec, or (an empty spec, why) when it no longer passes the spec's bounds (a row
    written before they existed): recovery must not stop on one old row."""
    try:
        return msgspec.json.decode(raw, type=JobSpec), None
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        return JobSpec(), f"the stored spec no longer passes the spec's bounds: {clip_text(str(exc), 1000)}"


def _stored_nodes(raw: str | None) -> list[NodeView]:
    """A multi-node job's node table as it was last saved (none: not a multi-node job, or unreadable)."""
    if raw is None:
        return []
    try:
        return msgspec.json.decode(raw, type=list[NodeView])
    except (msgspec.ValidationError, msgspec.DecodeError):
        return []


def job_from_row(row: Any) -> Job:
    spec, unreadable = _stored_spec(row["spec"])
    job = Job(
        id=row["id"], seq=row["seq"], name=row["name"], owner_uid=row["owner_uid"],
        spec=spec, state=JobState(row["state"]),
        submitted_at=row["submitted_at"], attempt=row["attempt"], started_at=row["started_at"],
        finished_at=row["finished_at"], reason=row["reason"],
        root_cause=None if row["root_cause"] is None else msgspec.json.decode(row["root_cause"], type=RootCause),
        idempotency_key=row["idempotency_key"], nodes=_stored_nodes(row["nodes"]),
    )
    if unreadable is not None and not job.state.final:  # never run a spec that is not the one submitted
        job.state, job.reason = JobState.FAILED, "spec_unreadable"
        job.root_cause = RootCause(reason="spec_unreadable", attempt=job.attempt, detail=unreadable)
    if job.state.final:
        job.finished.set()
    return job


def rank_from_row(row: Any) -> Rank:
    return Rank(
        rank=row["rank"], attempt=row["attempt"], state=RankState(row["state"]), pid=row["pid"], pgid=row["pgid"],
        step=row["step"], loss=row["loss"], exit_code=row["exit_code"], signal=row["signal"],
        checksum=row["checksum"], log=row["log"], stack_dump=bool(row["stack_dump"]),
        replacements=row["replacements"],
    )
