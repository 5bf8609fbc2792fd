"""`--after` decided as pure logic, and job ids resolved against a real journal (SQLite file)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from ddpd.daemon.queue.dependencies import Broken, Kind, Ready, Waiting, kinds_of, resolve_after, verdict
from ddpd.daemon.queue.jobids import MAX_CANDIDATES, AmbiguousJobError, UnknownJobError, resolve
from ddpd.daemon.queue.table import JobTable
from ddpd.daemon.store.bus import EventBus
from ddpd.daemon.store.journal import Journal
from ddpd.daemon.store.records import Job
from ddpd.daemon.store.state import StateDB
from ddpd.protocol import ErrorCode, JobSpec, JobState, SpecError

pytestmark = pytest.mark.anyio

Q, R, S, F, C = JobState.QUEUED, JobState.RUNNING, JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED


def test_verdict() -> None:
    assert verdict({}) == Ready()
    assert verdict({"j1-a": S, "j2-b": S}) == Ready()
    assert verdict({"j1-a": S, "j2-b": R, "j3-c": Q}) == Waiting(["j2-b", "j3-c"])
    assert verdict({"j1-a": R, "j2-b": F}) == Broken("dependency j2-b FAILED")
    assert verdict({"j1-a": C}) == Broken("dependency j1-a CANCELLED")
    assert verdict({"j1-a": JobState.TIMED_OUT}) == Broken("dependency j1-a TIMED_OUT")
    assert verdict({"j1-a": None}) == Broken("dependency j1-a no longer exists")


@pytest.fixture
def table(tmp_path: Path) -> Iterator[JobTable]:
    db = StateDB(tmp_path / "ddpd.db")

    async def no_sleep(_: float) -> None:
        await anyio.lowlevel.checkpoint()

    yield JobTable(Journal(db, EventBus(), retries=(0.0,), sleep=no_sleep), history=2)
    db.close()


async def add(table: JobTable, job_id: str, seq: int) -> Job:
    job = Job(id=job_id, seq=seq, name="t", owner_uid=1000, spec=JobSpec(task="two-layer"), state=JobState.QUEUED,
              submitted_at=time.time())
    await table.journal.create_job(job)
    table.add(job)
    return job


async def test_ids_resolve_whole_by_number_or_by_unique_prefix(table: JobTable) -> None:
    for seq in (1, 10, 11, 2):
        await add(table, f"j{seq}-ab{seq:02d}", seq)
    table.forget(table.jobs["j10-ab10"])  # only in the journal now: found there all the same
    assert (await resolve(table, "j1-ab01")).id == "j1-ab01"
    assert (await resolve(table, "j1")).id == "j1-ab01"  # job number 1, not j10 or j11
    assert (await resolve(table, "j10")).id == "j10-ab10"
    assert (await resolve(table, "j10-a")).id == "j10-ab10"
    assert (await resolve(table, "j2-")).id == "j2-ab02"
    await add(table, "j2-ab03", 3)  # not an id the daemon makes: two ids after one dash
    with pytest.raises(AmbiguousJobError) as info:
        await resolve(table, "j2-ab")
    assert info.value.code == ErrorCode.AMBIGUOUS
    assert info.value.candidates == ["j2-ab02", "j2-ab03"] and "j2-ab02, j2-ab03" in info.value.message
    for text in ("j", "j3", "j12-", "x", "ab01", "j1-ab01x", "j1%", "j\udc80", "j1\x00", "j1-ab01\n"):
        with pytest.raises(UnknownJobError):
            await resolve(table, text)
    await table.journal.delete_job("j1-ab01")
    table.forget(table.jobs["j1-ab01"], deleted=True)
    for text in ("j1", "j01", "j1-"):  # no job 1 now: never j10 or j11, never "ambiguous"
        with pytest.raises(UnknownJobError):
            await resolve(table, text)


async def test_an_ambiguous_prefix_lists_a_bounded_number_of_candidates(table: JobTable) -> None:
    for seq in range(1, MAX_CANDIDATES + 5):
        await add(table, f"j1-cafe{seq}", seq)
    with pytest.raises(AmbiguousJobError) as info:
        await resolve(table, "j1-ca")
    assert len(info.value.candidates) == MAX_CANDIDATES and info.value.message.endswith(", ...); give more of the id")


async def test_dependencies_are_stored_as_full_ids_once(table: JobTable) -> None:
    await add(table, "j1-aaaa", 1)
    await add(table, "j2-bbbb", 2)
    spec = await resolve_after(JobSpec(after=["j1", "j2-b", "j1-aaaa"]), table)
    assert spec.after == ["j1-aaaa", "j2-bbbb"]
    with pytest.raises(SpecError, match=r"after\[1\]: no job 'j7'"):
        await resolve_after(JobSpec(after=["j1", "j7"]), table)
    with pytest.raises(SpecError, match=r"after\[0\]: no job 'j'"):
        await resolve_after(JobSpec(after=["j"]), table)


async def test_a_dependency_that_already_failed_is_refused_naming_its_state(table: JobTable) -> None:
    """Bug: `--after` a failed job was accepted, then failed at once ("queued for 1.6s")."""
    done = await add(table, "j1-aaaa", 1)
    done.state = JobState.FAILED
    with pytest.raises(SpecError, match=r"after\[0\]: job j1-aaaa already ended FAILED"):
        await resolve_after(JobSpec(after=["j1"]), table)
    done.state = JobState.SUCCEEDED
    assert (await resolve_after(JobSpec(after=["j1"]), table)).after == ["j1-aaaa"]


def test_afterany_and_afternotok_verdicts() -> None:
    kinds: dict[str, Kind] = {"j1-a": "any", "j2-b": "notok"}
    assert verdict({"j1-a": F, "j2-b": F}, kinds) == Ready()
    assert verdict({"j1-a": S, "j2-b": C}, kinds) == Ready()
    assert verdict({"j1-a": R, "j2-b": Q}, kinds) == Waiting(["j1-a", "j2-b"])
    broken = verdict({"j1-a": S, "j2-b": S}, kinds)
    assert isinstance(broken, Broken) and broken.reason.startswith("dependency j2-b SUCCEEDED")
    spec = JobSpec(after=["j3-c"], after_any=["j1-a"], after_notok=["j2-b"])
    assert kinds_of(spec) == {"j3-c": "ok", "j1-a": "any", "j2-b": "notok"}
