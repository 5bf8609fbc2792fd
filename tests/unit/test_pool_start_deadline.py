"""The pool's start deadline (`WarmPool._hello`): a member that says nothing is late after
`pool_start_timeout` seconds in which no job held cores, never while a job holds them, and the
count starts again from when jobs let go. A real process (`sleep`) on a real socket pair."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from ddpd.daemon.config import Config
from ddpd.daemon.pool.pool import PoolWorker, WarmPool

from .pool_members import silent_member

pytestmark = pytest.mark.anyio

TIMEOUT = 0.3


@pytest.fixture
async def member() -> AsyncIterator[PoolWorker]:
    """A member that never says Hello: a sleeping process, its channel's other end held open."""
    async with silent_member() as w:
        yield w


def pool(tmp_path: Path, busy: list[int]) -> WarmPool:
    config = Config(state_dir=tmp_path / "state", socket=tmp_path / "s", pool_start_timeout=TIMEOUT)
    return WarmPool(config, busy_ranks=lambda: busy[0])


async def test_a_silent_member_is_late_after_the_timeout(tmp_path: Path, member: PoolWorker) -> None:
    p = pool(tmp_path, [0])
    started = time.monotonic()
    with anyio.fail_after(10):
        assert await p._hello(member) == (None, True)
    assert time.monotonic() - started >= TIMEOUT


async def test_the_count_waits_while_jobs_hold_cores_and_restarts_when_they_let_go(
    tmp_path: Path, member: PoolWorker
) -> None:
    busy = [2]
    p = pool(tmp_path, busy)
    p._yield_to_jobs()  # a job's start woke the pool: jobs hold cores
    result: list[object] = []
    said = anyio.Event()
    async with anyio.create_task_group() as tg:
        async def hello() -> None:
            result.append(await p._hello(member))
            said.set()

        tg.start_soon(hello)
        with anyio.move_on_after(4 * TIMEOUT):  # four timeouts while the job runs: never late
            await said.wait()
        assert result == []  # not late
        busy[0] = 0
        p._yield_to_jobs()  # the job's end woke the pool
        let_go = time.monotonic()
        with anyio.fail_after(10):
            await said.wait()
    assert result == [(None, True)]
    assert time.monotonic() - let_go >= TIMEOUT * 0.9  # counted from when the job let go, not from the spawn


async def test_a_member_that_ends_is_not_late(tmp_path: Path, member: PoolWorker) -> None:
    member.proc.kill()
    with anyio.fail_after(10):
        assert await pool(tmp_path, [0])._hello(member) == (None, False)
