"""The queue: jobs share the daemon's GPUs and CPU slots, wait in FIFO order with priority, and
the queue outlives a daemon restart. GPUs are fake here (`ddpd serve --gpus 2` on a CPU machine):
jobs ask for `gpus_per_rank=1, device="cpu"`, so the scheduler hands out GPU indices while the
workers train on the CPU."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from ddpd.client import RemoteError
from ddpd.protocol import JobState
from ddpd.protocol.control import EventView, JobView

from ..conftest import DaemonProc, running_daemon
from ..scripts.helpers import gated, rank_reports, wait_state, wait_waiting_at_gate

pytestmark = pytest.mark.anyio

TIMEOUT = 120


async def _finish(d: DaemonProc, job_ids: list[str]) -> list[JobView]:
    with anyio.fail_after(TIMEOUT):
        return [await d.client.wait(j) for j in job_ids]


async def _starts(d: DaemonProc) -> list[EventView]:
    async with d.client.events() as stream:
        return [e async for e in stream if e.kind == "job.state_changed" and e.data.get("to") == "STARTING"]


async def test_jobs_share_gpus_without_overlap_and_a_third_waits(short_tmp: Path) -> None:
    gate = short_tmp / "gate"
    async with running_daemon(short_tmp, "--gpus", "2") as d:
        info = await d.client.daemon_info()
        assert info.gpus == 2
        ids = [await d.client.submit(gated(d, gate, name=f"g{i}", gpus_per_rank=1, device="cpu"))
               for i in range(3)]
        for job_id in ids[:2]:
            await wait_waiting_at_gate(d, job_id)
        # both GPUs are taken: the third job waits, though CPU slots are free
        third = await d.client.status(ids[2])
        assert third.state == JobState.QUEUED and third.ranks == [] and third.queue_position == 1
        # each rank's GPU in status (memory only where NVML sees the process: never for these fake GPUs)
        assert {g.index for j in ids[:2] for r in (await d.client.status(j)).ranks for g in r.gpus} == {0, 1}
        info = await d.client.daemon_info()
        assert info.gpu_devices or info.gpu_note  # the figures, or why there are none
        seen = {job_id: (await rank_reports(d.client, job_id))[0] for job_id in ids[:2]}
        assert sorted(r["CUDA_VISIBLE_DEVICES"] for r in seen.values()) == ["0", "1"]
        assert all(r["LOCAL_RANK"] == "0" for r in seen.values())
        gate.touch()
        views = await _finish(d, ids)
        assert [v.state for v in views] == ["SUCCEEDED"] * 3
        first_end = min(v.finished_at or 0 for v in views[:2])
        assert views[2].started_at is not None and views[2].started_at >= first_end
        assert (await rank_reports(d.client, ids[2]))[0]["CUDA_VISIBLE_DEVICES"] in ("0", "1")


async def test_each_rank_of_a_gpu_job_gets_its_own_gpu(short_tmp: Path) -> None:
    async with running_daemon(short_tmp, "--gpus", "2") as d:
        spec = d.spec(task="tests.scripts.gated:make_task", nproc=2, gpus_per_rank=1, device="cpu", steps=2)
        view = await d.run(spec)
        assert view.state == JobState.SUCCEEDED, view.root_cause
        seen = await rank_reports(d.client, view.id)
        assert {r: (s["CUDA_VISIBLE_DEVICES"], s["LOCAL_RANK"]) for r, s in seen.items()} == {
            0: ("0", "0"), 1: ("1", "1")}


async def test_cpu_jobs_hide_gpus_and_take_one_slot_per_rank(short_tmp: Path) -> None:
    """A CPU job sees no GPU (CUDA_VISIBLE_DEVICES=""), so it can never use one given to another job;
    with 2 CPU slots a 2-rank CPU job and a 1-rank one run one after the other."""
    gate = short_tmp / "gate"
    async with running_daemon(short_tmp, "--gpus", "2", "--cpu-slots", "2") as d:
        big = await d.client.submit(gated(d, gate, nproc=2))
        small = await d.client.submit(gated(d, gate))
        await wait_waiting_at_gate(d, big, ranks=2)
        assert (await d.client.status(small)).state == JobState.QUEUED
        gate.touch()
        views = await _finish(d, [big, small])
        assert [v.state for v in views] == ["SUCCEEDED"] * 2
        assert views[1].started_at is not None and views[1].started_at >= (views[0].finished_at or 0)
        seen = await rank_reports(d.client, big)
        assert [seen[r]["CUDA_VISIBLE_DEVICES"] for r in (0, 1)] == ["", ""]


async def test_a_job_that_can_never_fit_is_refused_at_submit(short_tmp: Path) -> None:
    async with running_daemon(short_tmp, "--gpus", "2", "--cpu-slots", "2") as d:
        with pytest.raises(RemoteError) as gpus:
            await d.client.submit(d.spec(nproc=3, gpus_per_rank=1, device="cpu"))
        assert gpus.value.code == "bad_spec"
        assert gpus.value.message.startswith("gpus_per_rank:")
        assert "needs 3 GPUs" in gpus.value.message and "has 2" in gpus.value.message
        with pytest.raises(RemoteError) as cpus:
            await d.client.submit(d.spec(nproc=3))
        assert cpus.value.code == "bad_spec" and cpus.value.message.startswith("nproc:")
        assert "3 CPU slots" in cpus.value.message
        assert await d.client.list_jobs() == []


async def test_priority_goes_first_then_fifo(short_tmp: Path) -> None:
    gate = short_tmp / "gate"
    async with running_daemon(short_tmp, "--cpu-slots", "1") as d:
        blocker = await d.client.submit(gated(d, gate, name="blocker"))
        await wait_state(d, blocker, "STARTING")
        low1 = await d.client.submit(d.spec(name="low1", steps=1))
        high = await d.client.submit(d.spec(name="high", steps=1, priority=5))
        low2 = await d.client.submit(d.spec(name="low2", steps=1))
        urgent = await d.client.submit(d.spec(name="urgent", steps=1, priority=9))
        # the place in line is the scheduler's order, for the owner and in the list
        assert [(await d.client.status(j)).queue_position for j in (blocker, urgent, high, low1, low2)] == [
            None, 1, 2, 3, 4]
        listed = await d.client.list_jobs(all=False)
        assert {v.id: v.queue_position for v in listed} == {blocker: None, urgent: 1, high: 2, low1: 3, low2: 4}
        gate.touch()
        views = await _finish(d, [blocker, low1, high, low2, urgent])
        assert [v.state for v in views] == ["SUCCEEDED"] * 5
        assert [e.job_id for e in await _starts(d)] == [blocker, urgent, high, low1, low2]


async def test_queue_survives_a_daemon_restart_in_order(short_tmp: Path) -> None:
    gate = short_tmp / "gate"
    state = short_tmp / "state"
    async with running_daemon(short_tmp, "--cpu-slots", "1", state_dir=state) as d:
        blocker = await d.client.submit(gated(d, gate, name="blocker"))
        await wait_waiting_at_gate(d, blocker)
        q1 = await d.client.submit(d.spec(name="q1", steps=1))
        q2 = await d.client.submit(d.spec(name="q2", steps=1, priority=1))
        q3 = await d.client.submit(d.spec(name="q3", steps=1))
        # counted here: the restarted daemon starts the head of the queue as soon as it is ready
        starts_before = len(await _starts(d))
    gate.touch()
    async with running_daemon(short_tmp, "--cpu-slots", "1", state_dir=state) as d:
        # the running job stopped gracefully at the shutdown and went back to the queue, in its place
        async with d.client.events(blocker) as stream:
            requeued = [e async for e in stream if e.kind == "job.state_changed" and e.data["to"] == "QUEUED"]
        assert [e.data["reason"] for e in requeued] == ["daemon_shutdown"]
        views = await _finish(d, [blocker, q1, q2, q3])
        assert [v.state for v in views] == ["SUCCEEDED"] * 4
        assert views[0].attempt == 2
        order = [e.job_id for e in (await _starts(d))[starts_before:]]
        assert order == [q2, blocker, q1, q3]
