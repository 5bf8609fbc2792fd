"""The warm pool when a key's jobs change shape: a one-rank job after a two-rank job of the same key,
with the fork server (the default) and with whole interpreters (``pool_fork_server = false``).

The bug (interpreters): the job's start lowered its key's want (two jobs' worth of its ranks: 4,
then 2) before the job took an interpreter, and the pool's refill loop retired the surplus from
the ready interpreters, oldest first, ahead of the ones still starting; the job then found none
ready and started cold while a refill started beside it. Seen in the default-path soak
(tests/soak/test_default_path.py): its one-rank `mlp` job after a two-rank job started cold with one
interpreter ready (`pool.worker_retired` of that one, then the cold rank). A key's ranks about to
be taken are no surplus now (`WarmPool.use` claims them until the job's `take`).
"""

from __future__ import annotations

import re
from pathlib import Path

import anyio
import pytest

from ..conftest import DaemonProc, running_daemon

pytestmark = pytest.mark.anyio

JOB_WAIT = 120


async def pool_ready(d: DaemonProc, n: int) -> None:
    """The pool can give `n` ranks without a cold start: a ready fork server, or at least `n` ready
    interpreters; a state only the daemon's view shows, looked at every 50 ms."""
    with anyio.fail_after(JOB_WAIT):
        while True:
            info = await d.client.daemon_info()
            if re.match(r"warm \(\d+ fork servers? ready", info.pool_state or "") or (info.pool_ready or 0) >= n:
                return
            await anyio.sleep(0.05)


async def pooled(d: DaemonProc, job_id: str) -> list[bool]:
    async with d.client.events(job_id) as stream:
        return [bool(e.data.get("pooled")) async for e in stream if e.kind == "rank.spawned"]


@pytest.mark.parametrize("fork_server", [True, False], ids=["fork-server", "interpreters"])
async def test_a_one_rank_job_after_a_two_rank_job_starts_pooled(short_tmp: Path, fork_server: bool) -> None:
    config = short_tmp / "ddpd.toml"
    config.write_text(f"pool_fork_server = {str(fork_server).lower()}\n")
    async with running_daemon(short_tmp, "--config", str(config), "--gpus", "0", "--pool-size", "4") as d:
        await pool_ready(d, 2)
        first = await d.run(d.spec(task="two-layer", steps=2, nproc=2))  # the key now wants 4
        assert await pooled(d, first.id) == [True, True]
        await pool_ready(d, 1)  # what a refill made ready while others still start
        second = await d.run(d.spec(task="two-layer", steps=2, nproc=1))
        assert (first.state, second.state) == ("SUCCEEDED", "SUCCEEDED")
        assert await pooled(d, second.id) == [True]
