"""The state database: one SQLite connection (WAL), its schema and migrations, used off the event loop.

Durability: `synchronous=FULL`, so a state transition that returned is on disk even after a power loss
(WAL with NORMAL could lose the last transactions). A writer that finds the database locked waits up to
`BUSY_TIMEOUT` (SQLite's busy handler) before the call fails. The queries themselves live in the journal.
A state directory that cannot be used at start (not a directory, unwritable, read-only, a corrupt
database) raises `StorageError` naming the path and the problem.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TypeVar

import anyio
import anyio.to_thread
import structlog

from ..layout import database
from .errors import StorageError
from .private import create_database, make_dirs, narrow

T = TypeVar("T")
log = structlog.get_logger("ddpd")

BUSY_TIMEOUT = 2.0  # seconds a statement waits for another writer's lock before it fails
SCHEMA_VERSION = 7  # 4: the usage table (fair share); 5: ranks.replacements (hot replacement); 6: jobs.nodes;
# 7: jobs.stored_bytes (each user's history bounds)

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
    root_cause TEXT,
    idempotency_key TEXT,
    nodes TEXT,
    stored_bytes INTEGER
);
CREATE TABLE IF NOT EXISTS attempts (
    job_id TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    pgid INTEGER,
    store_port INTEGER,
    token TEXT NOT NULL,
    started_at REAL NOT NULL,
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
    replacements INTEGER NOT NULL DEFAULT 0,
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
CREATE TABLE IF NOT EXISTS curves (
    job_id TEXT PRIMARY KEY,
    data TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS usage (
    uid INTEGER PRIMARY KEY,
    gpu_seconds REAL NOT NULL,
    cpu_seconds REAL NOT NULL,
    at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS events_job ON events(job_id, seq);
CREATE INDEX IF NOT EXISTS ranks_job ON ranks(job_id, attempt);
"""


# columns added after the first release: (table, column, declaration)
MIGRATIONS = (("jobs", "idempotency_key", "TEXT"), ("attempts", "cgroup", "TEXT"),
              ("ranks", "replacements", "INTEGER NOT NULL DEFAULT 0"), ("jobs", "nodes", "TEXT"),
              ("jobs", "stored_bytes", "INTEGER"))
# columns of the first release that nothing ever wrote or read, dropped from databases that have them
RETIRED = (("attempts", "ended_at"), ("attempts", "root_cause"))
INDEXES = """
CREATE UNIQUE INDEX IF NOT EXISTS jobs_idempotency ON jobs(owner_uid, idempotency_key);
CREATE INDEX IF NOT EXISTS jobs_finished ON jobs(finished_at);
CREATE INDEX IF NOT EXISTS jobs_state ON jobs(state, seq);
CREATE INDEX IF NOT EXISTS jobs_owner_finished ON jobs(owner_uid, finished_at);
"""

# the bytes a job's record takes in the database (its row, events, ranks, attempts and curve), as
# `jobs.stored_bytes` holds them once it ended: what each user's history bound counts
STORED_BYTES = """
length(CAST(spec AS BLOB)) + length(CAST(name AS BLOB)) + coalesce(length(CAST(reason AS BLOB)), 0)
+ coalesce(length(root_cause), 0) + coalesce(length(nodes), 0) + coalesce(length(idempotency_key), 0) + 128
+ coalesce((SELECT sum(length(CAST(data AS BLOB)) + length(kind) + 48) FROM events WHERE job_id = jobs.id), 0)
+ coalesce((SELECT sum(coalesce(length(log), 0) + coalesce(length(signal), 0) + 96) FROM ranks
            WHERE job_id = jobs.id), 0)
+ coalesce((SELECT count(*) * 64 FROM attempts WHERE job_id = jobs.id), 0)
+ coalesce((SELECT length(data) FROM curves WHERE job_id = jobs.id), 0)
"""


class StateDB:
    """One connection, used from worker threads one call at a time."""

    def __init__(self, path: Path, busy_timeout: float = BUSY_TIMEOUT) -> None:
        self.path = path
        self._conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=busy_timeout)
        self._conn.row_factory = sqlite3.Row
        self._lock = threading.Lock()
        self._limiter = anyio.CapacityLimiter(1)
        with self._lock:
            self._conn.execute(f"PRAGMA busy_timeout={int(busy_timeout * 1000)}")
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=FULL")
            self._conn.executescript(SCHEMA)
            migrate(self._conn)
            self._conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")  # also proves the database is writable

    @classmethod
    def open_dir(cls, state_dir: Path) -> StateDB:
        """Create the state directory if needed and open its database, root's alone (store.private:
        created 0600, a wider one narrowed first, `state.files_narrowed`); a problem is one clear
        StorageError."""
        try:
            make_dirs(state_dir)
        except FileExistsError:
            raise StorageError(f"state directory {state_dir}: exists and is not a directory") from None
        except OSError as exc:
            raise StorageError(f"state directory {state_dir}: {exc.strerror or exc}") from None
        if not state_dir.is_dir():
            raise StorageError(f"state directory {state_dir}: not a directory")
        path = database(state_dir)
        try:
            narrowed = narrow(state_dir)
            create_database(state_dir)
            db = cls(path)
        except (sqlite3.Error, OSError) as exc:
            raise StorageError(f"state database {path}: {exc}") from None
        if narrowed:
            log.warning("state.files_narrowed", files=[asdict(n) for n in narrowed],
                        reason="readable by others: left by a daemon started under a wider umask")
        return db

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    async def run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        def call() -> T:
            with self._lock:
                return fn(self._conn)

        return await anyio.to_thread.run_sync(call, limiter=self._limiter)

    def run_sync(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        with self._lock:
            return fn(self._conn)


def migrate(conn: sqlite3.Connection) -> None:
    """Bring a database of an earlier release to this schema: columns added, and the retired ones
    (never written, never read, no index on them) dropped; rows are kept."""
    for table, column, decl in MIGRATIONS:
        if column not in _columns(conn, table):
            conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {decl}")
            if column == "stored_bytes":  # the ended jobs of before: counted once, here
                conn.execute(f"UPDATE jobs SET stored_bytes = ({STORED_BYTES}) WHERE finished_at IS NOT NULL")
    for table, column in RETIRED:
        if column in _columns(conn, table):
            conn.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
    conn.executescript(INDEXES)


def _columns(conn: sqlite3.Connection, table: str) -> set[str]:
    return {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}
