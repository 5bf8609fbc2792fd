"""Hot rank replacement: a rank killed mid-training is replaced in place; the survivors keep their
processes and state, and the job ends as an uninterrupted run of the same seed would."""

from __future__ import annotations

import math
import os
import random
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from ddpd.protocol import JobState
from ddpd.protocol.control import EventView, JobView

from ..conftest import DaemonProc, assert_gone, running_daemon
from .test_pool import pool_can_give

pytestmark = pytest.mark.anyio

STEP_SLEEP = 0.01
POOL = 6


@pytest.fixture
async def pooled(short_tmp: Path) -> AsyncIterator[DaemonProc]:
    """The default path: a daemon with its warm pool (a replacement comes from it when one is ready)."""
    config = short_tmp / "ddpd.toml"
    config.write_text(f"pool_per_key = {POOL}\n")  # one key (these jobs' shape) may hold the whole pool
    async with running_daemon(short_tmp, "--config", str(config), "--pool-size", str(POOL), "--cpu-slots", "8") as d:
        yield d


async def pool_holds(d: DaemonProc, n: int) -> None:
    """Wait until the pool can give `n` ranks without a cold start (a job's ranks, and spares for
    replacements): `n` ready interpreters, or a ready fork server (the default)."""
    await pool_can_give(d, n)


async def events_of(d: DaemonProc, job_id: str) -> list[EventView]:
    with anyio.fail_after(30):
        return [e async for e in d.client.events(job_id)]


async def kill_rank(d: DaemonProc, job_id: str, rank: int, after_step: int) -> tuple[int, dict[int, int]]:
    """SIGKILL `rank` once the job passed `after_step`; (its pid, every other rank's pid)."""
    await d.wait_event(job_id, lambda e: e.kind == "rank.progress" and e.data["step"] >= after_step)
    view = await d.client.status(job_id)
    pids = {r.rank: r.pid for r in view.ranks if r.pid is not None}
    victim = pids.pop(rank)
    os.kill(victim, signal.SIGKILL)
    return victim, pids


def checksums(job: JobView) -> set[float | None]:
    return {r.checksum for r in job.ranks}


def same_run(job: JobView, reference: JobView) -> bool:
    """Every rank holds the same parameters, those of the uninterrupted run: exactly with two ranks;
    with more, to the last bits of a float32 sum (a re-formed DDP lays its buckets out anew, so an
    all-reduce over more than two ranks may add in another order); a step lost or done twice
    moves the checksum by far more than that."""
    mine, theirs = checksums(job), checksums(reference)
    if len(mine) != 1 or len(theirs) != 1 or None in mine | theirs:
        return False
    a, b = next(iter(mine)), next(iter(theirs))
    assert a is not None and b is not None
    return a == b if len(job.ranks) == 2 else math.isclose(a, b, rel_tol=1e-6)


@pytest.mark.parametrize("nproc", [2, 4])
async def test_a_killed_rank_is_replaced_in_place_and_the_run_ends_as_an_uninterrupted_one(
        pooled: DaemonProc, nproc: int) -> None:
    d = pooled
    spec = d.spec(task="tests.tasks:slow", nproc=nproc, steps=400, seed=7, options={"step_sleep": STEP_SLEEP})
    reference = await d.run(spec)
    assert reference.state == JobState.SUCCEEDED, reference.root_cause
    assert len(checksums(reference)) == 1

    await pool_holds(d, nproc + 1)  # the ranks and a spare: the replacement is pooled
    job_id = await d.client.submit(spec)
    followed: list[EventView] = []  # progress is not stored: followed as it happens

    async def follow() -> None:
        async with d.client.events(job_id, follow=True) as stream:
            async for e in stream:
                if e.kind in ("rank.progress", "rank.replaced"):
                    followed.append(e)

    async with anyio.create_task_group() as tg:
        tg.start_soon(follow)
        victim, survivors = await kill_rank(d, job_id, 1, after_step=100)
        with anyio.fail_after(120):
            job = await d.client.wait(job_id)
        tg.cancel_scope.cancel()
    assert job.state == JobState.SUCCEEDED, job.root_cause
    assert job.attempt == 1, "the job restarted instead of replacing the rank"
    assert same_run(job, reference), (checksums(job), checksums(reference))
    assert {r.rank: r.pid for r in job.ranks if r.rank != 1} == survivors, "a survivor was replaced"
    assert job.ranks[1].pid != victim
    assert [r.replacements for r in job.ranks] == [0, 1] + [0] * (nproc - 2)
    events = await events_of(d, job_id)
    replaced = [e for e in events if e.kind == "rank.replaced"]
    assert len(replaced) == 1, [e.kind for e in events]
    data = replaced[0].data
    print("rank.replaced", data)
    assert replaced[0].rank == 1 and data["lost_pid"] == victim and data["generation"] == 1
    assert 0 < data["ready"] <= data["reformed"] <= data["seconds"] and data["pooled"] is True
    lost = [e for e in events if e.kind == "rank.lost"]
    assert len(lost) == 1 and lost[0].data["signal"] == "SIGKILL"
    # every rank's first step in the new group is seen at once. Bug: a survivor's was dropped by the
    # daemon's 0.2 s spacing of progress events, so the group was seen training again only at the
    # survivor's next report, a progress interval (1 s) later, many steps on
    first: dict[int, int] = {}
    for e in followed:
        if e.kind == "rank.progress" and e.rank is not None and e.data["step"] > data["step"]:
            first.setdefault(e.rank, e.data["step"])
    assert first == {r: data["step"] + 1 for r in range(nproc)}, (first, data["step"])
    exited = [e for e in events if e.kind == "rank.exited" and e.data.get("signal") == "SIGKILL"]
    assert [e.data.get("hot_replace") for e in exited] == ["replacing"], exited
    log = await anyio.Path(job.ranks[1].log or "").read_text()
    assert f"ddpd: rank 1 (pid {victim}) was lost" in log
    assert_gone(victim)


async def test_rank_0_and_jobs_that_allow_none_restart_as_before(pooled: DaemonProc) -> None:
    """Rank 0 serves the attempt's store: its loss restarts the attempt; so does any loss with --hot-replace 0."""
    d = pooled
    for rank, allowed in ((0, None), (1, 0)):
        spec = d.spec(task="tests.tasks:slow", nproc=2, steps=100_000, options={"step_sleep": STEP_SLEEP},
                      hot_replace=allowed)
        job_id = await d.client.submit(spec)
        await kill_rank(d, job_id, rank, after_step=5)
        with anyio.fail_after(60):
            job = await d.client.wait(job_id)
        assert job.state == JobState.FAILED
        assert job.root_cause is not None and job.root_cause.rank == rank and job.root_cause.signal == "SIGKILL"
        events = await events_of(d, job_id)
        kinds = [e.kind for e in events]
        assert "rank.replaced" not in kinds and "rank.lost" not in kinds
        why = [e.data.get("hot_replace") for e in events if e.kind == "rank.exited" and e.rank == rank]
        assert why == (["rank 0 serves the attempt's store"] if rank == 0 else [None]), why


async def replaced_or_why(d: DaemonProc, job_id: str, victim: int) -> EventView:
    """The `rank.replaced` of `victim`; else fail with why the job ended without it (what
    `rank.exited` said of the replacement, and the root cause)."""
    try:
        return await d.wait_event(job_id, lambda e: e.kind == "rank.replaced" and e.data["lost_pid"] == victim)
    except AssertionError:
        job = await d.client.status(job_id)
        said = [(e.rank, e.data.get("hot_replace"), e.data.get("signal")) for e in await events_of(d, job_id)
                if e.kind in ("rank.exited", "rank.replace_failed")]
        raise AssertionError(f"{victim} was not replaced: job {job.state} attempt {job.attempt}, "
                             f"{job.root_cause}; rank.exited/replace_failed: {said}") from None


async def test_a_replacement_lost_right_after_it_re_formed_is_replaced_in_turn(pooled: DaemonProc) -> None:
    """A replacement killed the moment the group re-formed around it (`rank.replaced`), before its
    first step there ends, is replaced in turn, and the job ends in its first attempt. Bug (CI, the
    chaos test below): a replacement counted as training only from its first report after it rebuilt
    DDP, and one lost before that was refused (tests/unit/test_replace.py pins the state)."""
    d = pooled
    slow = 0.2  # a fifth of a second per step: the replacement's first report comes that long after its re-form
    spec = d.spec(task="tests.tasks:slow", nproc=2, steps=40, seed=3, options={"step_sleep": slow}, hot_replace=2)
    await pool_holds(d, 4)
    job_id = await d.client.submit(spec)
    victim, _ = await kill_rank(d, job_id, 1, after_step=3)
    replaced = await replaced_or_why(d, job_id, victim)
    os.kill(replaced.data["pid"], signal.SIGKILL)  # at once: before its first step in the new group ends
    again = await replaced_or_why(d, job_id, replaced.data["pid"])
    assert again.data["generation"] == 2, again.data
    with anyio.fail_after(120):
        job = await d.client.wait(job_id)
    assert job.state == JobState.SUCCEEDED and job.attempt == 1, job.root_cause
    assert [r.replacements for r in job.ranks] == [0, 2]
    exited = [e for e in await events_of(d, job_id) if e.kind == "rank.exited" and e.data.get("signal") == "SIGKILL"]
    assert [e.data.get("hot_replace") for e in exited] == ["replacing", "replacing"], exited
    for pid in (victim, replaced.data["pid"]):
        assert_gone(pid)


async def test_chaos_a_random_rank_killed_again_and_again_still_ends_as_an_uninterrupted_run(
        pooled: DaemonProc) -> None:
    d = pooled
    spec = d.spec(task="tests.tasks:slow", nproc=3, steps=600, seed=11, options={"step_sleep": STEP_SLEEP},
                  hot_replace=3)
    reference = await d.run(spec)
    assert reference.state == JobState.SUCCEEDED, reference.root_cause
    await pool_holds(d, POOL)  # the ranks and a spare for each replacement
    job_id = await d.client.submit(spec)
    pick = random.Random(5)
    killed = []
    for round_ in range(3):
        rank = pick.choice([1, 2])  # rank 0 serves the store: its loss restarts (tested above)
        victim, _ = await kill_rank(d, job_id, rank, after_step=80 * (round_ + 1))
        killed.append(victim)
        await replaced_or_why(d, job_id, victim)
    with anyio.fail_after(120):
        job = await d.client.wait(job_id)
    assert job.state == JobState.SUCCEEDED and job.attempt == 1, job.root_cause
    assert same_run(job, reference), (checksums(job), checksums(reference))
    assert sum(r.replacements for r in job.ranks) == 3
    for pid in killed:
        assert_gone(pid)
