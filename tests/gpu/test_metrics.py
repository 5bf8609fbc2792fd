"""GPU gauges on the metrics endpoint: each GPU's memory and utilisation (NVML), and the job that holds it."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ddpd.daemon.gpu import gpus
from ddpd.protocol import JobState

from ..conftest import assert_nothing_left, running_daemon
from ..integration.test_service import _http_get
from .conftest import GpuWatch

pytestmark = pytest.mark.anyio


async def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    status, body = await _http_get(port, "/metrics")
    assert status == 200, body
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body) for s in family.samples}


async def test_gpu_gauges_show_memory_utilisation_and_the_holding_job(short_tmp: Path, gpu_watch: GpuWatch) -> None:
    nvml = gpus.nvml_discover()
    config = short_tmp / "ddpd.toml"
    config.write_text("metrics_public = true\n")
    async with running_daemon(short_tmp, "--config", str(config), "--metrics-listen", "127.0.0.1:0") as d:
        port = next(e for e in d.logs if e.get("event") == "metrics.listening")["port"]
        job_id = await d.client.submit(d.spec(task="tests.tasks:slow", nproc=1, steps=100_000, device="cuda",
                                              options={"step_sleep": 0.01}))
        await d.wait_event(job_id, lambda e: e.kind == "rank.progress" and e.data["step"] >= 2)
        series = await _scrape(port)
        for g in nvml:
            key = (("gpu", g.label), ("uuid", g.uuid))
            assert series[("ddpd_gpu_memory_total_bytes", key)] == g.memory_total
            assert 0 < series[("ddpd_gpu_memory_used_bytes", key)] <= (g.memory_total or 0)
        held = [dict(k) for (name, k), v in series.items() if name == "ddpd_gpu_job" and v == 1]
        # the first free GPU, this job's, named as status names it (NVML index and UUID)
        assert held == [{"gpu": nvml[0].label, "uuid": nvml[0].uuid, "job_id": job_id}]
        [rank_gpu] = (await d.client.status(job_id)).ranks[0].gpus
        assert (str(rank_gpu.index), rank_gpu.uuid) == (nvml[0].label, nvml[0].uuid)
        assert series[("ddpd_gpu_held_ratio", (("gpu", nvml[0].label), ("uuid", nvml[0].uuid)))] == 1.0
        assert any(name == "ddpd_gpu_utilization_percent" for name, _ in series)
        await d.client.cancel(job_id)
        with anyio.fail_after(60):
            job = await d.client.wait(job_id)
        assert job.state == JobState.CANCELLED
        series = await _scrape(port)
        assert not any(name == "ddpd_gpu_job" for name, _ in series)  # given back
    assert_nothing_left([job])
    gpu_watch.assert_free([job])
