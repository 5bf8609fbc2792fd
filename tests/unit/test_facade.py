"""The queue as control sees it (`queue.facade.Jobs`: eight methods) and the one live config every part
reads: no part of the queue keeps a `Config` of its own, and a reload is seen by each at its next read
(a copy forgotten in `reconfigure` kept the fair-share half-life of the start, whatever a reload said)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from ddpd.daemon.config import Config
from ddpd.daemon.queue.facade import JobQueue, Jobs, LiveConfig
from ddpd.daemon.queue.jobids import UnknownJobError
from ddpd.daemon.queue.resources import Resources
from ddpd.daemon.store.bus import EventBus
from ddpd.daemon.store.errors import LimitError, NotRunnableError
from ddpd.daemon.store.journal import Journal
from ddpd.daemon.store.state import StateDB
from ddpd.protocol import JobSpec

pytestmark = pytest.mark.anyio

SPEC = JobSpec(task="two-layer", nproc=1)
ANN = 1000


def config(tmp_path: Path, **kw: object) -> Config:
    return Config(state_dir=tmp_path, socket=tmp_path / "s", **kw)  # type: ignore[arg-type]


@pytest.fixture
async def queue(tmp_path: Path) -> AsyncIterator[JobQueue]:
    db = StateDB(tmp_path / "ddpd.db")
    yield JobQueue(LiveConfig(config(tmp_path)), Journal(db, EventBus()), Resources(0, 4))
    db.close()


def test_control_sees_eight_methods() -> None:
    assert sorted(name for name in vars(Jobs) if not name.startswith("_")) == [
        "cancel", "find", "overview", "page", "release_gpu", "remove", "stacks", "submit"]


def held_configs(root: object) -> Iterator[tuple[str, type]]:
    """(path, type) of every object of the queue reachable from `root`, and of every `Config` one holds
    (a LiveConfig is the one holder: not looked into)."""
    seen: set[int] = set()
    todo: list[tuple[str, object]] = [("queue", root)]
    while todo:
        path, obj = todo.pop()
        if id(obj) in seen or isinstance(obj, LiveConfig):
            continue
        seen.add(id(obj))
        if isinstance(obj, Config):
            yield path, Config
            continue
        if isinstance(obj, dict):
            todo.extend((f"{path}[{k!r}]", v) for k, v in obj.items())
        elif isinstance(obj, list | tuple | set | frozenset):
            todo.extend((f"{path}[]", v) for v in obj)
        elif type(obj).__module__.startswith("ddpd.daemon.queue") and hasattr(obj, "__dict__"):
            yield path, type(obj)
            todo.extend((f"{path}.{name}", value) for name, value in vars(obj).items())


async def test_no_part_of_the_queue_holds_a_config_of_its_own(queue: JobQueue) -> None:
    found = dict(held_configs(queue))
    parts = {t.__name__ for t in found.values()}
    # the walk reached every part that reads the config (a broken walk would find nothing to hold)
    assert {"History", "JobHooks", "GpuHealth", "Supervision", "FairShare", "Retention", "Scheduler",
            "Jobs"} <= parts, parts
    assert [path for path, t in found.items() if t is Config] == []


async def test_a_reload_is_seen_by_each_part_that_reads_the_config(queue: JobQueue, tmp_path: Path) -> None:
    jobs = queue.jobs
    assert jobs.overview().half_life == Config().fairshare_half_life
    first = (await jobs.submit(SPEC, ANN)).job
    await jobs.cancel(first, "test", force=False)
    new = config(tmp_path, max_queued=1, fairshare_half_life=60.0, retention=10.0, max_history_per_user=1,
                 cpu_slots=2)
    queue.reconfigure(new)
    # each part reads the new config: fair share (its half-life), the scheduler (admission: max_queued),
    # history (the bound a submit is told of), retention, the runners (the scheduler's is theirs)
    assert (jobs.overview().half_life, jobs.overview().cpu_slots) == (60.0, 2)
    done = await jobs.submit(SPEC, ANN)
    assert "max_history_per_user = 1" in done.notices[0], done.notices
    with pytest.raises(LimitError, match="max_queued"):
        await jobs.submit(SPEC, ANN + 1)
    assert queue.retention.retention == 10.0 and queue.scheduler.config is new


async def test_find_a_job_by_its_id_a_prefix_or_none(queue: JobQueue) -> None:
    jobs = queue.jobs
    job = (await jobs.submit(SPEC, ANN)).job
    assert await jobs.find(job.id) is job and await jobs.find(job.id.split("-")[0]) is job  # `j1`: its number
    assert await jobs.find("j99-beef", missing_ok=True) is None
    with pytest.raises(UnknownJobError):
        await jobs.find("j99-beef")
    assert jobs.overview(order=True).positions == {job.id: 1} and jobs.overview().positions == {}
    assert jobs.overview().queued == 1


async def test_stacks_of_a_job_that_runs_no_attempt_are_refused(queue: JobQueue) -> None:
    job = (await queue.jobs.submit(SPEC, ANN)).job
    with pytest.raises(NotRunnableError, match="QUEUED, not running"):
        await queue.jobs.stacks(job, None, native=False)
