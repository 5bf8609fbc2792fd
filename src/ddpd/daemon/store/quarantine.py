"""Quarantined GPUs, kept in the state database so a quarantine outlives the daemon: its table and
its three queries (load, hold, release), each run off the event loop through `StateDB`.

A row is one device by its scheduler entry (its UUID, or its position where the daemon knows GPUs
by count only), how views name it (`label`: NVML index and UUID), why it was quarantined, when,
and the job that was on it. Held until an admin releases it. A database error is a StorageError.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass

from .errors import StorageError
from .state import StateDB

SCHEMA = """
CREATE TABLE IF NOT EXISTS gpu_quarantine (
    entry TEXT PRIMARY KEY,
    label TEXT NOT NULL,
    reason TEXT NOT NULL,
    at REAL NOT NULL,
    job_id TEXT
);
"""


@dataclass(frozen=True)
class Quarantined:
    entry: str  # the scheduler's name of the device: its UUID (else its position)
    label: str  # "GPU 3 (GPU-5f2e...)"
    reason: str  # "Xid 79, fell off the bus"
    at: float
    job_id: str | None = None  # the job that was on it


def _ensure(conn: sqlite3.Connection) -> None:
    conn.executescript(SCHEMA)


async def load(db: StateDB) -> dict[str, Quarantined]:
    """Every quarantined device, by entry."""
    def fn(conn: sqlite3.Connection) -> dict[str, Quarantined]:
        _ensure(conn)
        rows = conn.execute("SELECT entry, label, reason, at, job_id FROM gpu_quarantine").fetchall()
        return {r["entry"]: Quarantined(r["entry"], r["label"], r["reason"], r["at"], r["job_id"]) for r in rows}

    return await db.run(fn)


async def hold(db: StateDB, entry: str, label: str, reason: str, job_id: str | None) -> Quarantined:
    """Record a quarantine (a device already held keeps its first reason) and return what is held."""
    record = Quarantined(entry, label, reason, time.time(), job_id)

    def fn(conn: sqlite3.Connection) -> None:
        _ensure(conn)
        conn.execute("INSERT OR IGNORE INTO gpu_quarantine (entry, label, reason, at, job_id) VALUES (?, ?, ?, ?, ?)",
                     (entry, label, reason, record.at, job_id))

    await _write(db, fn)
    return record


async def release(db: StateDB, entry: str) -> None:
    def fn(conn: sqlite3.Connection) -> None:
        _ensure(conn)
        conn.execute("DELETE FROM gpu_quarantine WHERE entry = ?", (entry,))

    await _write(db, fn)


async def _write(db: StateDB, fn: Callable[[sqlite3.Connection], None]) -> None:
    try:
        await db.run(fn)
    except sqlite3.Error as exc:
        raise StorageError(f"the GPU quarantine cannot be recorded: {exc}") from None
