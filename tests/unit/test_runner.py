"""A job's runner in process, with the daemon's queue and the simulated worker (benchmarks/simworker.sh,
real processes speaking the worker protocol, no torch): commands reach the running attempt through
the runner's stream, a cancel's caller returns once it was applied, a preemption meant for an
earlier attempt is ignored, the daemon's stop sends the job back to the queue, and a command sent
after the runner ended is dropped, its sender told."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import anyio.abc
import pytest

from ddpd.daemon.config import Config
from ddpd.daemon.queue.commands import Cancel, Preempt
from ddpd.daemon.queue.facade import JobQueue, LiveConfig
from ddpd.daemon.queue.resources import Resources
from ddpd.daemon.store.bus import EventBus
from ddpd.daemon.store.journal import Journal
from ddpd.daemon.store.records import Job
from ddpd.daemon.store.state import StateDB
from ddpd.protocol import PROTOCOL_VERSION, JobSpec, JobState

from ..conftest import assert_nothing_left

pytestmark = pytest.mark.anyio
SIMWORKER = Path(__file__).resolve().parents[2] / "benchmarks" / "simworker.sh"
WAIT = 30


@pytest.fixture
async def queue(tmp_path: Path) -> AsyncIterator[JobQueue]:
    db = StateDB(tmp_path / "ddpd.db")
    config = Config(state_dir=tmp_path, socket=tmp_path / "s", cgroup="off", heartbeat_interval=0.2,
                    worker_command=("/bin/bash", str(SIMWORKER), "--protocol", str(PROTOCOL_VERSION)))
    yield JobQueue(LiveConfig(config), Journal(db, EventBus()), Resources(0, 4))
    db.close()


async def running(queue: JobQueue, tg: anyio.abc.TaskGroup, **kw: object) -> Job:
    """A job of two simulated ranks, started and RUNNING (its ranks joined)."""
    events = queue.journal.bus.subscribe()
    tg.start_soon(queue.run)
    job = (await queue.jobs.submit(JobSpec(task="two-layer", nproc=2, steps=10**6, **kw), 0)).job  # type: ignore[arg-type]
    with anyio.fail_after(WAIT):
        async for event in events:
            if event.job_id == job.id and event.kind == "job.state_changed" and event.data["to"] == "RUNNING":
                break
    return job


async def test_a_cancel_returns_once_applied_and_a_later_command_is_dropped(queue: JobQueue) -> None:
    async with anyio.create_task_group() as tg:
        job = await running(queue, tg)
        runner = queue.runners.get(job.id)  # the runner under test: the one the queue started
        assert runner is not None and runner.attempt is not None
        await queue.jobs.cancel(job, "cancelled by test", force=False)
        assert job.cancel_requested == "cancelled by test"  # applied by the runner before the reply
        with anyio.fail_after(WAIT):
            await job.finished.wait()
        assert (job.state, job.reason) == (JobState.CANCELLED, "cancelled by test")
        with anyio.fail_after(WAIT):
            await queue.runners.idle()  # the runner ended (its job's task gave back its resources)
        late = runner.send(Cancel("too late", force=True))
        assert late.is_set() and job.cancel_requested == "cancelled by test"  # dropped: nothing to stop
        tg.cancel_scope.cancel()
    assert_nothing_left([job.view()])


async def test_a_preemption_of_an_earlier_attempt_is_ignored_and_the_stop_requeues(queue: JobQueue) -> None:
    async with anyio.create_task_group() as tg:
        job = await running(queue, tg, preemptible=True)
        runner = queue.runners.get(job.id)  # the runner under test: the one the queue started
        assert runner is not None and job.attempt == 1
        with anyio.fail_after(WAIT):
            await runner.send(Preempt(attempt=0, by="j9-beef", by_uid=0, by_priority=5)).wait()
        assert job.state is JobState.RUNNING and runner.attempt is not None and runner.attempt.outcome is None
        with anyio.fail_after(WAIT):
            await queue.shutdown(force=False)
        assert (job.state, job.reason, job.attempt) == (JobState.QUEUED, "daemon_shutdown", 1)
        assert queue.jobs.overview().running == ()
        kinds = [e.kind for e in await queue.journal.list_events(job.id, 0, 1000)]
        assert "job.preempt_requested" not in kinds and "job.finished" not in kinds
        tg.cancel_scope.cancel()
    assert_nothing_left([job.view()])
