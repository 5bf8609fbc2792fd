"""GPU health on a CPU machine: a real daemon whose NVML is the test stand-in (tests/fakenvml, whose
event sets deliver the Xid and ECC events a test appends to its file), real CPU ranks.

- an Xid 79 on the GPU a running job holds fails that attempt with a root cause naming the GPU and
  the Xid, quarantines the GPU, and the job's restart lands on the other GPU;
- the next job never gets the quarantined GPU (it waits for the healthy one);
- `ddpctl daemon`, `DaemonInfo` and the metrics show the quarantine and why; an Xid that is the
  application's own (13) quarantines nothing;
- another user's `ddpctl gpu release` is refused; the quarantine survives a daemon restart; root
  releases it (by UUID) and a job needing both GPUs runs.
"""

from __future__ import annotations

import os
from pathlib import Path

import anyio
import pytest

from ddpd.daemon.contain.identity import Identity
from ddpd.protocol import JobState

from ..conftest import assert_nothing_left
from ..fakenvml.pynvml import add_event
from ..scripts.helpers import gated, rank_reports, state_is, wait_waiting_at_gate
from .test_gpu_placement import UUIDS, _scrape, fake_gpu_daemon, nvml_state, shown
from .test_identity import as_user

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.xdist_group("users"),
    pytest.mark.skipif(os.geteuid() != 0, reason="another user's refused release needs root (useradd)"),
]


async def test_an_xid_quarantines_the_gpu_moves_the_job_and_only_an_admin_releases_it(
        users: tuple[Identity, Identity], public_tmp: Path) -> None:
    _, bob = users
    base = public_tmp
    gate = base / "gate"
    config = base / "ddpd.toml"
    config.write_text('socket_mode = "0666"\nmetrics_public = true\n')
    flags = ("--config", str(config), "--metrics-listen", "127.0.0.1:0")
    async with fake_gpu_daemon(base, nvml_state(2), *flags) as (d, path):
        port = next(e for e in d.logs if e.get("event") == "metrics.listening")["port"]
        job = await d.client.submit(gated(d, gate, gpus_per_rank=1, device="cpu", max_restarts=1))
        await wait_waiting_at_gate(d, job)
        first = (await d.client.status(job)).ranks[0].gpus[0].index
        other = 1 - first

        add_event(path, first, xid=13)  # the application's own fault: said, nothing quarantined
        said = await d.wait_event(None, lambda e: e.kind == "gpu.xid" and e.data.get("xid") == 13)
        assert said.data["critical"] is False
        add_event(path, first, xid=79)
        held = await d.wait_event(None, lambda e: e.kind == "gpu.quarantined")
        assert (held.data["gpu"], held.data["uuid"], held.data["jobs"]) == (str(first), UUIDS[first], [job])
        restart = await d.wait_event(job, state_is("RESTARTING"))
        assert restart.data["root_cause"] == f"GPU {first} ({UUIDS[first]}): Xid 79, fell off the bus"
        await d.wait_event(job, lambda e: state_is("RUNNING")(e) and e.attempt == 2)
        assert (await d.client.status(job)).ranks[0].gpus[0].index == other  # restarted elsewhere

        nxt = await d.client.submit(gated(d, gate, gpus_per_rank=1, device="cpu"))
        await d.wait_event(None, lambda e: e.kind == "job.submitted" and e.job_id == nxt)
        waiting = await d.client.status(nxt)
        assert waiting.state == JobState.QUEUED, waiting.pending  # the quarantined GPU is free, yet not given
        info = await d.client.daemon_info()
        assert [g.quarantined for g in info.gpu_devices if g.index == first] == ["Xid 79, fell off the bus"]
        assert info.free_gpus == 0
        assert "QUARANTINED: Xid 79, fell off the bus" in await shown(d, "daemon")
        series = await _scrape(port)
        assert series[("ddpd_gpu_quarantined", (("gpu", str(first)), ("reason", "Xid 79, fell off the bus"),
                                                ("uuid", UUIDS[first])))] == 1

        gate.touch()
        with anyio.fail_after(120):
            done = [await d.client.wait(j) for j in (job, nxt)]
        assert [j.state for j in done] == [JobState.SUCCEEDED] * 2
        assert (await rank_reports(d.client, nxt))[0]["CUDA_VISIBLE_DEVICES"] == UUIDS[other]

        refused = await as_user(bob, d, "gpu", "release", str(first))
        assert refused.returncode != 0 and "permission_denied" in refused.stderr.decode(), refused.stderr.decode()
        assert_nothing_left(done)

    async with fake_gpu_daemon(base, nvml_state(2), *flags) as (d, path):  # the same state directory
        info = await d.client.daemon_info()
        assert [g.quarantined for g in info.gpu_devices if g.index == first] == ["Xid 79, fell off the bus"]
        released = await d.client.gpu_release(UUIDS[first][:12])
        assert (released.gpu, released.reason) == (f"GPU {first} ({UUIDS[first]})", "Xid 79, fell off the bus")
        assert all(g.quarantined is None for g in (await d.client.daemon_info()).gpu_devices)
        both = await d.run(d.spec(task="two-layer", nproc=2, steps=2, gpus_per_rank=1, device="cpu"))
        assert both.state == JobState.SUCCEEDED, both.root_cause
        assert_nothing_left([both])


async def test_a_job_whose_gpus_stay_idle_is_warned_then_cancelled_and_status_shows_utilisation(
        short_tmp: Path) -> None:
    gate = short_tmp / "gate"
    config = short_tmp / "ddpd.toml"
    config.write_text("gpu_sample_interval = 0.2\ngpu_idle_after = 1.5\ngpu_idle_cancel = true\n")
    state = nvml_state(2)
    state["gpus"][0]["utilization"], state["gpus"][1]["utilization"] = 40, 0
    async with fake_gpu_daemon(short_tmp, state, "--config", str(config)) as (d, _):
        busy = await d.client.submit(gated(d, gate, gpus_per_rank=1, device="cpu"))  # GPU 0: the first free
        await wait_waiting_at_gate(d, busy)
        idle = await d.client.submit(gated(d, gate, gpus_per_rank=1, device="cpu"))
        running = await d.wait_event(idle, state_is("RUNNING"))
        warned = await d.wait_event(idle, lambda e: e.kind == "job.gpu_idle")
        assert warned.data["gpus"] == [f"GPU 1 ({UUIDS[1]})"] and warned.data["seconds"] >= 1.5
        assert warned.ts - running.ts >= 1.5  # not before the configured time
        with anyio.fail_after(60):
            ended = await d.client.wait(idle)
        assert ended.state == JobState.CANCELLED and (ended.reason or "").startswith("gpu_idle"), ended.reason
        view = await d.client.status(busy)
        assert view.state == JobState.RUNNING  # its GPU is busy: neither warned nor cancelled
        assert set(view.ranks[0].gpus[0].utilization) == {40}
        assert "40/40" in await shown(d, "status", busy)
        gate.touch()
        with anyio.fail_after(60):
            done = await d.client.wait(busy)
        assert done.state == JobState.SUCCEEDED
        async with d.client.events(busy) as events:
            assert not [e async for e in events if e.kind == "job.gpu_idle"]
        assert_nothing_left([ended, done])
