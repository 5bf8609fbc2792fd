"""SQLite persistence (WAL): jobs, attempts, ranks and events. Every call runs off the event loop."""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import anyio
import anyio.to_thread

T = TypeVar("T")

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    seq INTEGER NOT NULL,
    name TEXT NOT NULL,
    owner_uid INTEGER NOT NULL,
    spec TEXT NOT NULL,
    state TEXT NOT NULL,
    attempt INTEGER NOT NULL DEFAULT 0,
    priority INTEGER NOT NULL DEFAULT 0,
    submitted_at REAL NOT NULL,
    started_at REAL,
    finished_at REAL,
    reason TEXT,
    root_cause TEXT
);
CREATE TABLE IF NOT EXISTS attempts (
    job_id TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    pgid INTEGER,
    store_port INTEGER,
    token TEXT NOT NULL,
    started_at REAL NOT NULL,
    ended_at REAL,
    root_cause TEXT,
    PRIMARY KEY (job_id, attempt)
);
CREATE TABLE IF NOT EXISTS ranks (
    job_id TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    rank INTEGER NOT NULL,
    state TEXT NOT NULL,
    pid INTEGER,
    pgid INTEGER,
    step INTEGER NOT NULL DEFAULT 0,
    loss REAL,
    exit_code INTEGER,
    signal TEXT,
    checksum REAL,
    log TEXT,
    stack_dump INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (job_id, attempt, rank)
);
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    ts REAL NOT NULL,
    job_id TEXT,
    attempt INTEGER,
    rank INTEGER,
    kind TEXT NOT NULL,
    data TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_job ON events(job_id, seq);
"""


class StateDB:
    """One connection, used from worker threads one call at a time."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._conn.row_factory = sqlite3.Row
        self._lock = threading.Lock()
        self._limiter = anyio.CapacityLimiter(1)
        with self._lock:
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=NORMAL")
            self._conn.executescript(SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    async def run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        def call() -> T:
            with self._lock:
                return fn(self._conn)

        return await anyio.to_thread.run_sync(call, limiter=self._limiter)

    async def execute(self, sql: str, params: tuple[Any, ...] | dict[str, Any] = ()) -> int:
        def fn(conn: sqlite3.Connection) -> int:
            cur = conn.execute(sql, params)
            return int(cur.lastrowid or 0)

        return await self.run(fn)

    async def query(self, sql: str, params: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        return await self.run(lambda conn: conn.execute(sql, params).fetchall())

    def query_sync(self, sql: str, params: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._conn.execute(sql, params).fetchall()

    async def upsert(self, table: str, key: tuple[str, ...], row: dict[str, Any]) -> None:
        cols = ", ".join(row)
        marks = ", ".join(f":{c}" for c in row)
        updates = ", ".join(f"{c}=excluded.{c}" for c in row if c not in key)
        sql = f"INSERT INTO {table} ({cols}) VALUES ({marks}) ON CONFLICT({', '.join(key)}) DO UPDATE SET {updates}"
        await self.execute(sql, row)

    async def add_event(
        self, ts: float, job_id: str | None, attempt: int | None, rank: int | None, kind: str, data: dict[str, Any]
    ) -> int:
        return await self.execute(
            "INSERT INTO events (ts, job_id, attempt, rank, kind, data) VALUES (?, ?, ?, ?, ?, ?)",
            (ts, job_id, attempt, rank, kind, json.dumps(data, default=str)),
        )
