"""Jobs that play tricks with their own rank logs: the daemon never follows them, keeps answering
`ping` within a bound throughout, ends the job as asked, and leaves no process behind.

(A rank flooding its channel and a log replaced by a FIFO are in the fault suite; the chaos soak
mixes them all.)
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import anyio
import pytest

from ddpd.protocol import JobState

from ..conftest import DaemonProc, assert_nothing_left
from ..faults.helpers import Pinger
from ..rawclient import cancel, ping_within, serving_daemon

pytestmark = pytest.mark.anyio

PING_BOUND = 2.0  # seconds, on a shared 2-core machine


async def test_a_rank_log_swapped_for_a_symlink_is_never_followed(door: DaemonProc, short_tmp: Path) -> None:
    """Rank 0 points its log at /dev/zero (an endless read), rank 1 at a file that is not the job's:
    `logs` reports both as not followed and ends at once; neither target is read or written."""
    victim = short_tmp / "victim"
    victim.write_text("SECRET of another user\n")
    job_id = await door.client.submit(door.spec(
        task="tests.tasks:symlink_log", nproc=2, steps=10_000,
        options={"target0": "/dev/zero", "target1": str(victim), "at_step": 2, "step_sleep": 0.05}))
    swapped: set[int] = set()
    with anyio.fail_after(120):  # the handshake: the daemon, following the logs, meets both symlinks
        async with door.client.logs(job_id, follow=True) as chunks:
            async for chunk in chunks:
                assert "SECRET" not in chunk.text and "\0" not in chunk.text
                if chunk.error:
                    assert "symlink" in chunk.error, chunk
                    swapped.add(chunk.rank)
                    if swapped == {0, 1}:
                        break
    pinger, done = Pinger(door, bound=PING_BOUND), anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(pinger.run, done)
        with anyio.fail_after(10):  # a whole read of the logs ends: nothing endless is streamed
            chunks_read = [c async for c in door.client.logs(job_id)]
        assert {c.rank for c in chunks_read if c.error} == {0, 1}, chunks_read
        assert sum(len(c.text) for c in chunks_read) < 1 << 20
        assert (await door.client.status(job_id)).state == JobState.RUNNING  # training goes on
        assert (await cancel(door.client, job_id)).action == "stopping"
        with anyio.fail_after(120):
            view = await door.client.wait(job_id)
        done.set()
    assert view.state == JobState.CANCELLED, view.root_cause
    assert victim.read_text() == "SECRET of another user\n"
    assert pinger.count > 0 and pinger.worst < PING_BOUND
    print(f"\nsymlinked logs: worst ping {pinger.worst * 1e3:.1f} ms over {pinger.count} pings")
    assert_nothing_left([view])


async def test_a_rank_writing_its_log_flat_out_while_followed(door: DaemonProc) -> None:
    """A rank writes its log as fast as it can (emptying it every 64 MiB) while a client follows it:
    ping stays answered, a force cancel ends the job, and the follower's stream ends with the job."""
    job_id = await door.client.submit(door.spec(
        task="tests.tasks:fill_log", steps=10_000, options={"log_bytes": 64 << 20, "wrap": True}))
    filling, plenty, ended = anyio.Event(), anyio.Event(), anyio.Event()
    followed = 0

    async def follow() -> None:
        nonlocal followed
        async with door.client.logs(job_id, follow=True) as chunks:
            async for chunk in chunks:
                followed += len(chunk.text)
                if "FILLING" in chunk.text or "f" * 100 in chunk.text:
                    filling.set()
                if followed >= 32 << 20:
                    plenty.set()
        ended.set()

    pinger, done = Pinger(door, bound=PING_BOUND), anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(follow)
        with anyio.fail_after(120):
            await filling.wait()
        tg.start_soon(pinger.run, done)
        with anyio.fail_after(60):  # the follower keeps receiving while the rank writes
            await plenty.wait()
        assert (await cancel(door.client, job_id, force=True)).action == "killing"
        with anyio.fail_after(120):
            view = await door.client.wait(job_id)
        done.set()
        with anyio.fail_after(60):  # the follow-stream ends once the job has (after what is left)
            await ended.wait()
    assert view.state == JobState.CANCELLED, view.root_cause
    assert pinger.count > 0 and pinger.worst < PING_BOUND
    print(f"\nlog flat out: {followed / 2**20:.0f} MiB followed; worst ping {pinger.worst * 1e3:.1f} ms "
          f"over {pinger.count} pings")
    await ping_within(door.client, PING_BOUND)
    assert_nothing_left([view])


async def test_a_rank_log_past_its_limit_rotates_keeping_the_newest(short_tmp: Path) -> None:
    """A rank writing 4 MiB into a log limited to 256 KiB: the daemon rotates it on its own fd (the
    newest part moves to rank-0.log.1, the live log starts over), the job ends as usual, and `logs`
    keeps reading the live log."""
    config = short_tmp / "ddpd.toml"
    config.write_text(f"rank_log_max = {256 * 1024}\n")
    async with serving_daemon(short_tmp, "--config", str(config)) as d:
        job_id = await d.client.submit(d.spec(task="tests.tasks:fill_log", nproc=1, steps=40,
                                              options={"log_bytes": 4 << 20, "rank": 0, "at_step": 1,
                                                       "step_sleep": 0.1}))
        rotated = await d.wait_event(job_id, lambda e: e.kind == "rank.log_rotated")
        # the newest half of the limit, plus what the rank wrote while it was copied, up to another half
        assert rotated.data["kept"] <= 256 * 1024 and rotated.data["dropped"] > 0
        with anyio.fail_after(120):
            job = await d.client.wait(job_id)
        assert job.state == JobState.SUCCEEDED, job.root_cause
        log = job.ranks[0].log or ""
        backup = os.stat(f"{log}.1")
        assert stat.S_ISREG(backup.st_mode) and backup.st_size <= 256 * 1024
        assert os.stat(log).st_size < 4 << 20  # the live log did not keep the whole 4 MiB
        chunks = [c async for c in d.client.logs(job_id)]
        assert all(not c.error for c in chunks)
        assert_nothing_left([job])
