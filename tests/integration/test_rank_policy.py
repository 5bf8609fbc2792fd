"""A CPU job's ranks run at SCHED_BATCH under the default `cpu_rank_policy` (docs/operations.md):
every thread of every rank, pooled or cold, and whatever the script starts; `normal` leaves them
at SCHED_OTHER. Real daemons, real torch (gloo's own threads are among those checked)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ddpd.protocol import JobState

from ..conftest import DaemonProc, running_daemon
from ..scripts.helpers import SCRIPTS, rank_reports
from .test_gpu_placement import fake_gpu_daemon, nvml_state
from .test_pool import POOL, pool_full

pytestmark = pytest.mark.anyio

SHOW_POLICY = str(SCRIPTS / "show_policy.py")


async def policies(d: DaemonProc) -> tuple[list[bool], dict[int, dict[str, object]]]:
    """Run show_policy.py on two ranks; whether each rank was pooled, and what each printed."""
    job = await d.run(d.spec(script=[SHOW_POLICY], nproc=2))
    assert job.state == JobState.SUCCEEDED, job.root_cause
    async with d.client.events(job.id) as stream:
        pooled = [bool(e.data.get("pooled")) async for e in stream if e.kind == "rank.spawned"]
    return pooled, await rank_reports(d.client, job.id)


def assert_all(reports: dict[int, dict[str, object]], policy: int) -> None:
    assert sorted(reports) == [0, 1]
    for rank, seen in reports.items():
        threads = seen["threads"]
        assert isinstance(threads, dict) and len(threads) >= 3, f"rank {rank}: {seen}"  # main, ddpd's, gloo's
        assert set(threads.values()) == {policy}, f"rank {rank}: {seen}"
        assert seen["started"] == policy and seen["child"] == policy, f"rank {rank}: {seen}"


async def test_cold_ranks_and_what_they_start_run_at_sched_batch(daemon: DaemonProc) -> None:
    pooled, reports = await policies(daemon)
    assert pooled == [False, False]
    assert_all(reports, os.SCHED_BATCH)


async def test_pooled_ranks_run_at_sched_batch(short_tmp: Path) -> None:
    async with running_daemon(short_tmp, "--pool-size", str(POOL), "--cpu-slots", "4") as d:
        await pool_full(d)
        pooled, reports = await policies(d)
    assert pooled == [True, True]
    assert_all(reports, os.SCHED_BATCH)


async def test_normal_policy_leaves_sched_other(short_tmp: Path) -> None:
    config = short_tmp / "ddpd.toml"
    config.write_text('cpu_rank_policy = "normal"\n')
    async with running_daemon(short_tmp, "--config", str(config)) as d:
        pooled, reports = await policies(d)
    assert pooled == [False, False]
    assert_all(reports, os.SCHED_OTHER)


async def test_a_job_holding_gpus_stays_at_sched_other(short_tmp: Path) -> None:
    """The batch policy is for CPU jobs: a job given GPUs (NVML's stand-in here, its ranks on CPU)
    keeps SCHED_OTHER, its launch threads' latency untested on a GPU."""
    async with fake_gpu_daemon(short_tmp, nvml_state(2)) as (d, _):
        job = await d.run(d.spec(script=[SHOW_POLICY], nproc=2, gpus_per_rank=1, device="cpu"))
        assert job.state == JobState.SUCCEEDED, job.root_cause
        assert_all(await rank_reports(d.client, job.id), os.SCHED_OTHER)
