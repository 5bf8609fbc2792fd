"""The Prometheus exposition, read back with prometheus-client's own parser: the scheduler's series, a job's
curve, a live rank's memory and CPU (a real child process), GPU series from a sample (NVML's shape), the
library's escaping, and the bounds of a resource sample."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from ddpd.daemon.control.metrics import Metrics
from ddpd.daemon.control.samplers import RankTarget, Usage, sample
from ddpd.daemon.gpu.gpus import GpuInfo
from ddpd.daemon.queue.facade import Overview
from ddpd.daemon.queue.resources import Resources
from ddpd.daemon.store.bus import EventBus
from ddpd.daemon.store.curves import CurveStore
from ddpd.daemon.store.journal import Journal
from ddpd.daemon.store.records import Job, Rank
from ddpd.daemon.store.state import StateDB
from ddpd.protocol import JobSpec, JobState, RankState
from ddpd.protocol.control import EventView

pytestmark = pytest.mark.anyio

VERSION = 'v1 "quoted"\\ and\nnewline'  # a label value the exposition must escape


GPUS = [GpuInfo(index=i, name="H200", uuid=f"GPU-{i}", memory_total=141 << 30, memory_used=i << 30,
                utilization=None if i else 97, source="nvml") for i in range(2)]


def samples(text: str) -> dict[str, list[Sample]]:
    out: dict[str, list[Sample]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append(s)
    return out


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    yield proc
    assert proc.stdin is not None
    proc.stdin.close()
    proc.wait(timeout=30)


@pytest.fixture
async def journal(tmp_path: Path) -> AsyncIterator[Journal]:
    db = StateDB(tmp_path / "ddpd.db")
    yield Journal(db, EventBus())
    db.close()


def running_job(pid: int) -> Job:
    job = Job(id="j7-beef", seq=7, name="t", owner_uid=1000, spec=JobSpec(task="two-layer", nproc=2, steps=100),
              state=JobState.RUNNING, submitted_at=time.time(), attempt=1, gpus=["GPU-1"])
    job.ranks = [Rank(rank=0, attempt=1, state=RankState.TRAINING, pid=pid, step=12, last_frame=time.monotonic()),
                 Rank(rank=1, attempt=1, state=RankState.TRAINING, pid=None, step=11, last_frame=time.monotonic())]
    return job


def overview(job: Job, resources: Resources) -> Overview:
    """The jobs as the queue's facade shows them with `job` running on `resources` (no worker here)."""
    states = dict.fromkeys(JobState, 0) | {JobState.RUNNING: 1}
    return Overview(accepting=True, positions={}, running=(job,), states=states, active=1, queued=0, shares=(),
                    half_life=0.0, cpu_slots=resources.total_cpu, free_cpu_slots=resources.free_cpu,
                    gpus=resources.total_gpus, free_gpus=len(resources.free_gpus))


async def test_scrape_has_the_daemon_job_rank_and_process_series(journal: Journal,
                                                                 child: subprocess.Popen[bytes]) -> None:
    job, resources = running_job(child.pid), Resources(GPUS, 4)
    curves = CurveStore(journal)
    for step, loss in ((1, 2.0), (11, 1.0)):
        curves.observe(EventView(seq=0, ts=100.0 + step, kind="rank.progress", job_id=job.id, attempt=1, rank=0,
                                 data={"step": step, "loss": loss}))
    metrics = Metrics(lambda: overview(job, resources), resources, time.monotonic(), VERSION, curves, gpus=False)
    metrics.observe(EventView(seq=0, ts=1.0, kind="job.state_changed", job_id=job.id, attempt=1,
                              data={"to": "STARTING"}))
    metrics.observe(EventView(seq=0, ts=3.5, kind="job.state_changed", job_id=job.id, attempt=1,
                              data={"to": "RUNNING"}))
    got = samples((await metrics.render()).decode())

    assert got["ddpd_info"][0].labels == {"version": VERSION}
    assert {s.labels["state"]: s.value for s in got["ddpd_jobs"]}["RUNNING"] == 1
    assert {s.labels["kind"]: s.value for s in got["ddpd_cpu_slots"]} == {"total": 4, "free": 4}
    assert {s.labels["kind"]: s.value for s in got["ddpd_gpus"]} == {"total": 2, "free": 2}
    assert {s.labels["state"]: s.value for s in got["ddpd_ranks"]}["TRAINING"] == 2
    assert [(s.labels, s.value) for s in got["ddpd_job_step"]] == [({"job_id": job.id}, 12)]
    assert [(s.labels, s.value) for s in got["ddpd_job_loss"]] == [({"job_id": job.id}, 1.0)]
    assert got["ddpd_job_steps_per_second"][0].value == pytest.approx(1.0)
    rss = got["ddpd_rank_resident_memory_bytes"]
    assert [s.labels for s in rss] == [{"job_id": job.id, "attempt": "1", "rank": "0"}] and rss[0].value > 1e6
    assert got["ddpd_rank_cpu_seconds_total"][0].value >= 0
    assert got["ddpd_launch_seconds_count"][0].value == 1 and got["ddpd_launch_seconds_sum"][0].value == 2.5
    assert {s.labels["le"] for s in got["ddpd_launch_seconds_bucket"]} >= {"0.5", "+Inf"}
    assert "process_resident_memory_bytes" in got and "python_info" in got
    assert not any(name.startswith("ddpd_gpu_") for name in got)  # no NVML asked: no GPU series, no error


async def test_gpu_series_name_the_job_that_holds_each_gpu() -> None:
    job, resources = running_job(pid=2**22 + 1), Resources(GPUS, 4)
    metrics = Metrics(lambda: overview(job, resources), resources, time.monotonic(), "v", gpus=False)
    metrics.collector.usage = Usage(gpus=[*GPUS, GpuInfo(index=2, name="H200", uuid="GPU-2", memory_total=1,
                                                         memory_used=0, utilization=0, source="nvml")])
    got = samples(generate_latest(metrics.registry).decode())
    # named as everywhere (NVML index and UUID); a GPU NVML lists but the daemon does not schedule: none
    assert [(s.labels, s.value) for s in got["ddpd_gpu_job"]] == [({"gpu": "1", "uuid": "GPU-1", "job_id": job.id}, 1)]
    assert [(s.labels["gpu"], s.value) for s in got["ddpd_gpu_held_ratio"]] == [("0", 0.0), ("1", 0.0)]
    assert [s.value for s in got["ddpd_gpu_memory_used_bytes"]] == [0, 1 << 30]
    assert [s.value for s in got["ddpd_gpu_memory_total_bytes"]] == [141 << 30] * 2
    assert [(s.labels["gpu"], s.value) for s in got["ddpd_gpu_utilization_percent"]] == [("0", 97)]


def test_a_sample_reads_only_children_and_stops_at_its_budget(child: subprocess.Popen[bytes]) -> None:
    mine = RankTarget("j1-a", 1, 0, child.pid)
    foreign = RankTarget("j1-a", 1, 1, 1)  # pid 1: not a child of this process
    usage = sample([mine, foreign], gpus=False)
    assert [u.target for u in usage.ranks] == [mine] and usage.skipped == 1
    ticks = iter(range(100))
    usage = sample([mine] * 10, budget=2, gpus=False, clock=lambda: float(next(ticks)))
    assert len(usage.ranks) == 2 and usage.skipped == 8
