"""The test harness itself: a test that fails while its daemon runs leaves no daemon behind."""

from __future__ import annotations

import os
from pathlib import Path

import anyio
import pytest

from ..conftest import assert_gone, start_daemon

pytestmark = pytest.mark.anyio


class Boom(Exception):
    pass


async def test_a_failing_test_does_not_leak_its_daemon(short_tmp: Path) -> None:
    """Bug guard: a failed assertion in a test that started its daemon with start_daemon (not
    running_daemon) left the daemon running after the suite."""
    started: list[int] = []

    async def failing_test() -> None:
        async with anyio.create_task_group() as tg:
            d = await start_daemon(tg, short_tmp)
            started.append(d.proc.pid)
            os.kill(d.proc.pid, 0)  # it runs
            raise Boom

    with pytest.raises(BaseExceptionGroup) as failed:
        await failing_test()
    assert failed.group_contains(Boom)
    [pid] = started
    assert_gone(pid)  # stopped and reaped when the task group unwound
