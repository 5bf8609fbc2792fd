"""A bounded chaos soak against the real daemon: several clients at once submit (one retries a submit
with its idempotency key), cancel (graceful and force) and query (status, `ls` page by page, events,
logs) while jobs crash, hang, flood their channel, fill their logs and swap their log for a FIFO.

Afterwards: every accepted job reached exactly one final state (one `job.finished` event, and the
database agrees with it and with `status`), no job ran an attempt twice or more attempts than its
restarts allow, the daemon answered every ping within PING_BOUND throughout, and no process of any
job is left. The order of submissions and queries comes from a fixed seed. Run with -s for the
counts (jobs per final state, pings and their worst latency).
"""

from __future__ import annotations

import random
import sqlite3
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest

from ddpd.protocol import JobState
from ddpd.protocol.control import EventView, JobView

from ..conftest import DaemonProc, assert_nothing_left
from ..rawclient import all_jobs, serving_daemon

pytestmark = [pytest.mark.anyio, pytest.mark.soak]

SEED = 20261203
PING_BOUND = 2.0  # seconds for one ping (connect, hello, ping) on a shared 2-core machine
PING_EVERY = 0.05
QUERY_EVERY = 0.05
SOAK_TIMEOUT = 150.0  # the whole soak, submissions to the last final state (about 25 s here)
QUERY_TIMEOUT = 30.0
CONFIG = "cpu_slots = 6\nidle_timeout = 10.0\nframe_timeout = 5.0\n"
SHORT = {"progress": 2.0, "kill_grace": 1.0}
SLOW = {"task": "tests.tasks:slow", "steps": 10_000, "options": {"step_sleep": 0.05}}


@dataclass(frozen=True)
class Kind:
    """A kind of job in the soak: its spec, the final state it must reach, and what the client does."""

    name: str
    spec: dict[str, Any]
    final: JobState
    cancel: str | None = None  # "graceful" or "force" once it trains; "queued" at once
    restarts: int = 0


KINDS = [
    Kind("ok", {"task": "two-layer", "steps": 5}, JobState.SUCCEEDED),
    Kind("ok-retried", {"task": "two-layer", "steps": 5}, JobState.SUCCEEDED),
    Kind("crash", {"task": "tests.tasks:fail_at_step", "nproc": 2, "options": {"rank": 1, "at_step": 2}},
         JobState.FAILED),
    Kind("crash-restarted", {"task": "tests.tasks:fail_at_step", "max_restarts": 1, "options": {"at_step": 2}},
         JobState.FAILED, restarts=1),
    Kind("hang", {"task": "tests.tasks:hang_in_training", "timeouts": SHORT, "options": {"at_step": 2}},
         JobState.TIMED_OUT),
    Kind("flood", {"task": "tests.tasks:flood_heartbeats", "options": {"at_step": 2}}, JobState.FAILED),
    Kind("fill-log", {"task": "tests.tasks:fill_log", "steps": 3, "options": {"log_bytes": 8 << 20}},
         JobState.SUCCEEDED),
    Kind("fifo-log", {"task": "tests.tasks:fifo_log_then_hang", "timeouts": SHORT, "options": {"at_step": 2}},
         JobState.TIMED_OUT),
    Kind("cancel", SLOW, JobState.CANCELLED, cancel="graceful"),
    Kind("cancel-force", SLOW, JobState.CANCELLED, cancel="force"),
    Kind("cancel-queued", {"task": "two-layer", "nproc": 6}, JobState.CANCELLED, cancel="queued"),
]


@dataclass
class Soak:
    d: DaemonProc
    rng: random.Random
    kinds: dict[str, Kind] = field(default_factory=dict)  # job id -> its kind
    pings: list[float] = field(default_factory=list)
    queries: Counter[str] = field(default_factory=Counter)
    retried: list[tuple[str, str, bool]] = field(default_factory=list)  # (first id, retry id, existing)

    async def submit(self, kind: Kind, tg: anyio.abc.TaskGroup, number: int) -> None:
        key = f"soak-{number}" if kind.name == "ok-retried" else None
        first = await self.d.client.submit_result(self.d.spec(name=kind.name, **kind.spec), idempotency_key=key)
        self.kinds[first.job_id] = kind
        if key is not None:  # a client that lost the reply submits again: the same job, never a second
            again = await self.d.client.submit_result(self.d.spec(name=kind.name, **kind.spec), idempotency_key=key)
            self.retried.append((first.job_id, again.job_id, again.existing))
        if kind.cancel is not None:
            tg.start_soon(self.cancel, first.job_id, kind.cancel)

    async def cancel(self, job_id: str, how: str) -> None:
        if how != "queued":
            await self.d.wait_event(job_id, lambda e: e.kind == "rank.progress", timeout=SOAK_TIMEOUT)
        with anyio.fail_after(QUERY_TIMEOUT):
            await self.d.client.cancel(job_id, force=how == "force")

    async def submitter(self, jobs: list[tuple[int, Kind]], tg: anyio.abc.TaskGroup) -> None:
        for number, kind in jobs:
            with anyio.fail_after(QUERY_TIMEOUT):
                await self.submit(kind, tg, number)

    async def querier(self) -> None:
        """Status, `ls` pages, events and logs of jobs picked by the seeded generator, until cancelled."""
        while True:
            ids = sorted(self.kinds)
            what = self.rng.choice(["status", "ls", "events", "logs", "info"])
            with anyio.fail_after(QUERY_TIMEOUT):
                if what == "status" and ids:
                    await self.d.client.status(self.rng.choice(ids))
                elif what == "ls":
                    before = None
                    while True:
                        page = await self.d.client.list_page(limit=3, before=before)
                        if page.next is None:
                            break
                        before = page.next
                elif what == "events" and ids:
                    async with self.d.client.events(self.rng.choice(ids)) as events:
                        async for _ in events:
                            pass
                elif what == "logs" and ids:
                    async with self.d.client.logs(self.rng.choice(ids)) as chunks:
                        read = 0
                        async for _ in chunks:
                            read += 1
                            if read == 4:
                                break  # leave early: the stream is closed mid-way
                else:
                    await self.d.client.daemon_info()
            self.queries[what] += 1
            await anyio.sleep(QUERY_EVERY)  # pacing, not ordering

    async def pinger(self) -> None:
        while True:
            start = time.perf_counter()
            with anyio.fail_after(PING_BOUND):
                await self.d.client.ping()
            self.pings.append(time.perf_counter() - start)
            await anyio.sleep(PING_EVERY)  # pacing, not ordering


@pytest.fixture
async def soak_daemon(short_tmp: Path) -> AsyncIterator[DaemonProc]:
    config = short_tmp / "ddpd.toml"
    config.write_text(CONFIG)
    async with serving_daemon(short_tmp, "--config", str(config), "--gpus", "0") as d:
        yield d


def database_rows(db: Path) -> tuple[dict[str, tuple[str, int]], Counter[str]]:
    """(job id -> (state, attempt)) and the number of attempt rows per job, read from the database."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10) as conn:
        jobs = {row[0]: (row[1], row[2]) for row in conn.execute("SELECT id, state, attempt FROM jobs")}
        attempts = Counter(row[0] for row in conn.execute("SELECT job_id FROM attempts"))
    return jobs, attempts


def check_job(view: JobView, kind: Kind, events: list[EventView], row: tuple[str, int], attempts: int) -> None:
    finished = [e for e in events if e.kind == "job.finished"]
    assert len(finished) == 1, (kind.name, [e.kind for e in events])
    assert finished[0].data["state"] == view.state == row[0] == kind.final.value, (kind.name, view.reason)
    rendezvous = [e.attempt for e in events if e.kind == "job.rendezvous"]
    assert len(rendezvous) == len(set(rendezvous)), (kind.name, rendezvous)  # no attempt ran twice
    assert view.attempt == row[1] == attempts, (kind.name, view.attempt, row, attempts)
    if kind.cancel != "queued":  # a job cancelled as it starts may end before its rendezvous
        assert len(rendezvous) == attempts, (kind.name, rendezvous, attempts)
    assert view.attempt <= 1 + kind.restarts, (kind.name, view.attempt)
    if kind.restarts:
        assert view.attempt == 1 + kind.restarts, (kind.name, view.attempt)
    elif kind.cancel != "queued":
        assert view.attempt == 1, (kind.name, view.attempt)


async def test_chaos_soak(soak_daemon: DaemonProc) -> None:
    d = soak_daemon
    rng = random.Random(SEED)
    soak = Soak(d, random.Random(rng.random()))
    plan = list(enumerate(KINDS))
    rng.shuffle(plan)
    started = time.perf_counter()
    with anyio.fail_after(SOAK_TIMEOUT):
        async with anyio.create_task_group() as watchers:
            watchers.start_soon(soak.pinger)
            for _ in range(2):
                watchers.start_soon(soak.querier)
            async with anyio.create_task_group() as clients:
                for i in range(3):
                    clients.start_soon(soak.submitter, plan[i::3], clients)
            views = {job_id: await d.client.wait(job_id) for job_id in sorted(soak.kinds)}
            watchers.cancel_scope.cancel()
    seconds = time.perf_counter() - started

    assert len(views) == len(KINDS)
    assert [(first == again, existing) for first, again, existing in soak.retried] == [(True, True)]
    rows, attempts = await anyio.to_thread.run_sync(database_rows, d.state_dir / "ddpd.db")
    assert set(rows) == set(views)  # no ghost, no second job for the retried submit
    assert {j.id for j in await all_jobs(d.client)} == set(views)
    for job_id, view in views.items():
        events = [e async for e in d.client.events(job_id)]
        check_job(view, soak.kinds[job_id], events, rows[job_id], attempts[job_id])
    assert_nothing_left([await d.client.status(job_id) for job_id in views])

    pings = sorted(soak.pings)
    states = Counter(view.state for view in views.values())
    print(f"\nsoak (seed {SEED}): {len(views)} jobs in {seconds:.1f} s: "
          + ", ".join(f"{state} {n}" for state, n in sorted(states.items()))
          + f"; {sum(soak.queries.values())} queries ({dict(sorted(soak.queries.items()))}); "
          f"{len(pings)} pings, p50 {pings[len(pings) // 2] * 1e3:.1f} ms, "
          f"p99 {pings[int(len(pings) * 0.99)] * 1e3:.1f} ms, worst {pings[-1] * 1e3:.1f} ms")
    assert pings[-1] < PING_BOUND
