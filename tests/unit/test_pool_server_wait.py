"""A job's rank and its key's fork server that is still starting (`WarmPool._server`): the rank goes
through the server once it is ready, starts cold at once when the server fails, and never waits
longer than it was given, nor longer than ``pool_server_wait`` from the server's spawn; a key whose first
job comes before the pool planned its server waits for that plan. Real processes (`sleep`) on real
socket pairs stand for the servers; the pool's loop is driven by hand."""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest
from anyio.abc import TaskGroup

from ddpd.daemon.config import Config
from ddpd.daemon.pool.pool import PoolWorker, WarmPool
from ddpd.daemon.pool.poolkeys import Shape

from .pool_members import KEY, silent_member

pytestmark = pytest.mark.anyio

SHAPE = Shape(key=KEY, argv=(sys.executable,), env={}, cwd="/", identity=None)  # a job of KEY


@pytest.fixture
async def server() -> AsyncIterator[PoolWorker]:
    """A fork server that has not said Hello yet: a sleeping process, its channel's other end held open."""
    async with silent_member(server=True) as w:
        yield w


def fork_pool(tmp_path: Path, server_wait: float = 10.0) -> WarmPool:
    p = WarmPool(Config(state_dir=tmp_path / "state", socket=tmp_path / "s", pool_fork_server=True,
                        pool_server_wait=server_wait))
    assert p.fork
    return p


async def waiting_rank(tg: TaskGroup, p: WarmPool) -> list[PoolWorker | None]:
    """A rank's start that may wait 30 s for `KEY`'s server, under way in `tg` until it blocks: what it
    got, once it has (a list, empty until then)."""
    got: list[PoolWorker | None] = []

    async def rank() -> None:
        got.append(await p._server(KEY, wait=30))

    tg.start_soon(rank)
    await anyio.wait_all_tasks_blocked()
    return got


def starting(p: WarmPool, w: PoolWorker) -> None:
    p._starting.add(w)
    p._workers.add(w)


def ready(p: WarmPool, w: PoolWorker) -> None:
    """What `_watch` does at the server's Hello."""
    p._starting.discard(w)
    p._ready.setdefault(w.key, deque()).append(w)
    assert w.server is not None
    w.server.settled.set()


async def test_a_rank_waits_for_the_keys_starting_server_and_goes_through_it(
    tmp_path: Path, server: PoolWorker
) -> None:
    p = fork_pool(tmp_path)
    starting(p, server)
    async with anyio.create_task_group() as tg:
        got = await waiting_rank(tg, p)
        assert got == []  # waiting for the server, not cold
        ready(p, server)
    assert got == [server]


async def test_a_server_that_fails_to_start_sends_the_waiting_rank_cold_at_once(
    tmp_path: Path, server: PoolWorker
) -> None:
    p = fork_pool(tmp_path)
    starting(p, server)
    async with anyio.create_task_group() as tg:
        got = await waiting_rank(tg, p)
        started = time.monotonic()
        p._starting.discard(server)  # what `_watch`'s end does: it failed
        assert server.server is not None
        server.server.settled.set()
    assert got == [None]
    assert time.monotonic() - started < 5


async def test_the_wait_is_bounded_by_what_the_rank_was_given(tmp_path: Path, server: PoolWorker) -> None:
    p = fork_pool(tmp_path)
    starting(p, server)
    started = time.monotonic()
    with anyio.fail_after(10):
        assert await p._server(KEY, wait=0.3) is None
    assert time.monotonic() - started >= 0.3 * 0.9


async def test_the_wait_ends_pool_server_wait_seconds_after_the_servers_spawn(
    tmp_path: Path, server: PoolWorker
) -> None:
    """However long the rank may wait, a server that has been starting for ``pool_server_wait`` s is
    not waited for any more: a job's every rank does not wait in turn for one stuck server."""
    p = fork_pool(tmp_path, server_wait=0.5)
    server.spawned_at = time.monotonic() - 0.3
    starting(p, server)
    started = time.monotonic()
    with anyio.fail_after(10):
        assert await p._server(KEY, wait=30) is None
    first = time.monotonic() - started
    assert 0.2 * 0.9 <= first < 5
    with anyio.fail_after(10):
        assert await p._server(KEY, wait=30) is None  # the next rank: no wait at all
    assert time.monotonic() - started - first < 0.2


async def test_a_keys_first_job_waits_for_the_plan_that_starts_its_server(
    tmp_path: Path, server: PoolWorker
) -> None:
    p = fork_pool(tmp_path)
    p.use(SHAPE, 2)
    async with anyio.create_task_group() as tg:
        got = await waiting_rank(tg, p)
        assert got == []  # the pool has not planned the key yet: no server to go through, but not cold
        p._plans.begin()  # the pool's next plan starts the server ...
        starting(p, server)
        p._plans.end()  # ... and is done
        await anyio.wait_all_tasks_blocked()
        assert got == []  # now waiting for the server itself
        ready(p, server)
    assert got == [server]


async def test_a_key_the_plan_gave_no_server_starts_cold_after_the_plan(tmp_path: Path) -> None:
    p = fork_pool(tmp_path)
    p.use(SHAPE, 2)
    async with anyio.create_task_group() as tg:
        got = await waiting_rank(tg, p)
        assert got == []
        p._plans.begin()  # a plan that spawns nothing for it (a backoff, the user's share)
        p._plans.end()
    assert got == [None]


async def test_a_known_key_with_no_server_starting_goes_cold_at_once(tmp_path: Path) -> None:
    p = fork_pool(tmp_path)
    with anyio.fail_after(1):
        assert await p._server(KEY, wait=30) is None


async def test_pool_server_wait_0_never_waits(tmp_path: Path, server: PoolWorker) -> None:
    p = fork_pool(tmp_path, server_wait=0)
    starting(p, server)
    with anyio.fail_after(1):
        assert await p._server(KEY, wait=30) is None


async def test_the_wait_for_a_plan_is_bounded_by_pool_server_wait(tmp_path: Path) -> None:
    """A pool whose loop never plans again (it is stopping) holds a key's first job at most
    ``pool_server_wait`` s, however long the rank may wait."""
    p = fork_pool(tmp_path, server_wait=0.3)
    p.use(SHAPE, 2)
    started = time.monotonic()
    with anyio.fail_after(10):
        assert await p._server(KEY, wait=30) is None
    assert 0.3 * 0.9 <= time.monotonic() - started < 5
