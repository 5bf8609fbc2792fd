"""Replies stay one frame whatever a job or a user stored: a 400 KB exception message, specs near
the request limit, hundreds of jobs; `ls` pages; cancel says what it did; a rank log that became a
FIFO is reported, never read."""

from __future__ import annotations

import os

import anyio
import msgspec
import pytest

from ddpd.protocol import MAX_FRAME, JobState
from ddpd.protocol.control import JobView

from ..conftest import DaemonProc
from ..rawclient import all_jobs, call, cancel, page, ping_within, result, send_raw

pytestmark = pytest.mark.anyio


async def test_a_400_kb_exception_message_does_not_break_status_wait_or_ls(door: DaemonProc) -> None:
    """The bug: one job whose exception message was 400 KB made status, wait, watch and ls fail for
    every user, for good (`internal: frame of 1201479 bytes exceeds 1048576`)."""
    ids = [await door.client.submit(door.spec(task="tests.adversarial.tasks:huge_failure", nproc=2, steps=5))
           for _ in range(2)]
    with anyio.fail_after(180):
        views = [await door.client.wait(job_id) for job_id in ids]  # wait answers
    for view in views:
        assert view.state == JobState.FAILED and view.root_cause is not None
        assert len(view.root_cause.message or "") <= 8192
        assert "missing keys" in (view.root_cause.message or view.root_cause.detail or "")
    assert (await door.client.status(ids[0])).state == JobState.FAILED
    listed = await all_jobs(door.client)
    assert [j.id for j in listed] == ids[::-1]  # newest first
    events = await send_raw(door.client, b'{"op":"events","id":3,"job_id":"' + ids[0].encode() + b'"}\n')
    assert events[-1]["type"] == "end" and all(r["type"] == "item" for r in events[:-1])
    await ping_within(door.client, 5)


async def test_ls_pages_under_the_frame_limit(door: DaemonProc) -> None:
    """Specs near the 64 KiB request limit: `ls` pages instead of failing (the bug: two 700 KB specs
    broke it). Queued jobs only: a job needing more slots than free waits, so nothing runs."""
    big = {f"K{i}": "v" * 200 for i in range(250)}  # about 55 KB of env
    blocker = await door.client.submit(door.spec(task="tests.tasks:slow", steps=10_000, nproc=1,
                                                 options={"step_sleep": 0.05}))
    slots = (await door.client.daemon_info()).cpu_slots
    queued = [await door.client.submit(door.spec(task="two-layer", nproc=slots, env=big, name=f"big{i}"))
              for i in range(24)]
    first = await page(door.client, limit=500)
    assert 0 < len(first.jobs) < 25 and first.next is not None
    assert len(msgspec.json.encode(first)) < MAX_FRAME
    everything = await all_jobs(door.client)
    assert [j.id for j in everything] == [*queued[::-1], blocker]
    active = await all_jobs(door.client, active_only=True)
    assert {j.id for j in active} == {*queued, blocker}
    one = await page(door.client, limit=1)
    assert [j.id for j in one.jobs] == [queued[-1]]
    for job_id in [*queued, blocker]:
        await cancel(door.client, job_id, force=True)
    with anyio.fail_after(120):
        await door.client.wait(blocker)
    assert await all_jobs(door.client, active_only=True) == []  # the bug: --active listed ended jobs


async def test_cancel_says_what_it_did(door: DaemonProc) -> None:
    running = await door.client.submit(door.spec(task="tests.tasks:slow", steps=10_000,
                                                 options={"step_sleep": 0.05}))
    await door.wait_event(running, lambda e: e.kind == "rank.progress")
    slots = (await door.client.daemon_info()).cpu_slots
    queued = await door.client.submit(door.spec(task="two-layer", nproc=slots))
    done = await cancel(door.client, queued)
    assert (done.action, done.job.state) == ("cancelled", JobState.CANCELLED)
    stopping = await cancel(door.client, running)
    assert stopping.action == "stopping"
    again = await cancel(door.client, running)
    assert again.action == "already_stopping"
    with anyio.fail_after(120):
        ended = await door.client.wait(running)
    assert ended.state == JobState.CANCELLED
    reply = await call(door.client, {"op": "cancel", "job_id": running})
    assert reply["code"] == "not_runnable" and "CANCELLED" in reply["message"], reply


async def test_a_fifo_in_place_of_a_rank_log_is_reported(door: DaemonProc) -> None:
    view = await door.run(door.spec(task="two-layer", nproc=2, steps=1))
    log0 = view.ranks[0].log or ""  # <state_dir>/users/<uid>/jobs/<job>/attempt-<n>/rank-0.log
    os.unlink(log0)
    os.mkfifo(log0)
    with anyio.fail_after(20):
        replies = await send_raw(door.client, b'{"op":"logs","id":4,"job_id":"' + view.id.encode() + b'"}\n')
    assert replies[-1]["type"] == "end"
    chunks = [r["item"] for r in replies if r["type"] == "item"]
    assert any(c["rank"] == 0 and "not a regular file" in c.get("error", "") for c in chunks), chunks
    assert all(c["rank"] == 1 for c in chunks[1:]), chunks  # the other rank's log is read as before
    await ping_within(door.client, 5)


async def test_rm_forgets_an_ended_job(door: DaemonProc) -> None:
    view = await door.run(door.spec(task="two-layer", steps=1))
    running = await door.client.submit(door.spec(task="tests.tasks:slow", steps=10_000))
    reply = await call(door.client, {"op": "rm", "job_id": running})
    assert reply["code"] == "not_runnable", reply
    assert await result(door.client, {"op": "rm", "job_id": view.id}) == {"job_id": view.id}
    reply = await call(door.client, {"op": "status", "job_id": view.id})
    assert reply["code"] == "not_found"
    await cancel(door.client, running, force=True)
    with anyio.fail_after(120):
        await door.client.wait(running)
    assert [j.id for j in await all_jobs(door.client)] == [running]
    assert isinstance((await all_jobs(door.client))[0], JobView)
