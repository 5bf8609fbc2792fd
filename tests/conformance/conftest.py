"""Fixtures of the conformance tier: per test module, two real daemons in the default configuration,
one with its warm pool as shipped (a fork server per key: its ranks are forked) and one with none
(every rank cold), shared by the module's tests; afterwards both are stopped and nothing of any job,
and no pool process (server, spare, interpreter), is left."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from ..conftest import assert_gone, running_daemon
from ..integration.test_pool import pool_pids_seen
from .harness import Daemons

POOL_SIZE = "4"  # the default configuration's (daemon_argv gives 0 unless a later flag says otherwise)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "conformance: the differential tier, scripts under torchrun and under ddpd (tests/conformance)")


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def module_tmp() -> Iterator[Path]:
    """A short directory for the module's daemons (Unix socket paths are limited to 108 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="ddpd-c"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
async def daemons(module_tmp: Path) -> AsyncIterator[Daemons]:
    (module_tmp / "p").mkdir()
    (module_tmp / "c").mkdir()
    async with running_daemon(module_tmp / "p", "--pool-size", POOL_SIZE) as pooled, \
            running_daemon(module_tmp / "c") as cold:
        yield Daemons(pooled=pooled, cold=cold)
    seen = pool_pids_seen(pooled)
    assert seen, "the pooled daemon never started a pool process"
    for pid in seen:
        assert_gone(pid)
