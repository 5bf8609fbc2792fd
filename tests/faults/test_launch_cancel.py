"""A conclusion while the attempt is still starting its ranks: the launch runs beside the attempt's
decision loop (attempt/start.py, attempt/loop.py), so a cancel can come between two rank starts."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from ddpd.protocol import JobState

from ..conftest import assert_nothing_left, running_daemon
from .helpers import await_gone, events_of

pytestmark = pytest.mark.anyio

NPROC = 24  # cold starts, each written twice to the journal: the launch outlasts a cancel's round trip


async def test_a_cancel_during_the_launch_starts_no_further_rank_and_leaves_none(short_tmp: Path) -> None:
    """The cancel comes once the first rank is started: no rank starts after the conclusion (every
    `rank.spawned` comes before the teardown's first event, and not all NPROC start), each one
    started is the job's and is torn down, and none is left."""
    async with running_daemon(short_tmp, "--cpu-slots", str(NPROC)) as d:
        spec = d.spec(task="mlp", nproc=NPROC, steps=1_000_000, timeouts={"kill_grace": 1.0})
        job_id = await d.client.submit(spec)
        await d.wait_event(job_id, lambda e: e.kind == "rank.spawned")
        await d.client.cancel(job_id)
        with anyio.fail_after(120):
            job = await d.client.wait(job_id)
        assert job.state == JobState.CANCELLED, job.root_cause
        events = await events_of(d, job_id)
        spawned = [e for e in events if e.kind == "rank.spawned"]
        teardown = [e for e in events if e.kind in ("job.stop_requested", "job.teardown", "job.torn_down")]
        assert teardown and all(e.seq < teardown[0].seq for e in spawned), [(e.kind, e.rank) for e in events]
        # bug this guards: a launch that went on after the conclusion started all NPROC ranks (a
        # cancel that came after the whole launch would too: then this test ran no race)
        assert len(spawned) < NPROC, "every rank started: the launch went on after the cancel"
        assert sorted(r.pid for r in job.ranks if r.pid is not None) == sorted(e.data["pid"] for e in spawned)
        for e in spawned:
            await await_gone(e.data["pid"], 10)
        assert_nothing_left([job])
