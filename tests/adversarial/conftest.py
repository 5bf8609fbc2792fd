"""Hostile clients against a real daemon: small limits, so that floods and timeouts take seconds."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from ..conftest import DaemonProc
from ..rawclient import serving_daemon

LIMITS = "max_connections = 16\nidle_timeout = 3.0\nframe_timeout = 1.0\n"


@pytest.fixture
async def door(short_tmp: Path) -> AsyncIterator[DaemonProc]:
    config = short_tmp / "ddpd.toml"
    config.write_text(LIMITS)
    async with serving_daemon(short_tmp, "--config", str(config)) as d:
        yield d
