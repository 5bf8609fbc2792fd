"""GPU placement on a CPU machine: a real daemon whose NVML is the test stand-in (tests/fakenvml, first
on the daemon's PYTHONPATH), real CPU ranks that print the CUDA_VISIBLE_DEVICES they were given.

- a daemon started with CUDA_VISIBLE_DEVICES=2,3 places jobs on those physical GPUs, by UUID;
- fractions pack (two 0.5 ranks on one GPU), a whole-GPU job takes the other, a third job waits;
- the same GPU is named alike (NVML index and UUID) in `status`, `ddpctl daemon` and the metrics;
- a script sees the job's GPUs and its own in DDPD_CUDA_DEVICES; every job gets a collective
  timeout, which a script that gives none joins with;
- a GPU job whose torch has no CUDA fails naming why (this CPU wheel);
- draining: a rank that cannot be killed (frozen in a cgroup v1 freezer: uninterruptible) keeps
  its GPU from the next job until it is gone and NVML no longer lists it.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
from msgspec.structs import replace
from prometheus_client.parser import text_string_to_metric_families

from ddpd.protocol import JobState
from ddpd.protocol.control import RankGpu

from ..conftest import REPO, DaemonProc, assert_nothing_left, running_daemon
from ..fakenvml.pynvml import write_state
from ..scripts.helpers import SCRIPTS, gated, rank_reports, wait_state, wait_waiting_at_gate
from .test_cli import DDPCTL
from .test_service import _http_get

pytestmark = pytest.mark.anyio

FAKE = REPO / "tests" / "fakenvml"
FREEZER = Path("/sys/fs/cgroup/freezer")
UUIDS = [f"GPU-{i}{i}{i}{i}aaaa-0000-0000-0000-00000000000{i}" for i in range(4)]


def nvml_state(n: int) -> dict[str, Any]:
    return {"gpus": [{"name": "NVIDIA H200", "uuid": UUIDS[i], "memory_total": 140 << 30, "memory_used": 1 << 20,
                      "utilization": 5, "processes": []} for i in range(n)]}


@asynccontextmanager
async def fake_gpu_daemon(base: Path, state: dict[str, Any], *flags: str,
                          visible: str | None = None) -> AsyncIterator[tuple[DaemonProc, Path]]:
    path = base / "nvml.json"
    write_state(path, state)
    env = {"FAKE_NVML": str(path), "PYTHONPATH": os.pathsep.join([str(FAKE), os.environ.get("PYTHONPATH", "")])}
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    async with running_daemon(base, "--cpu-slots", "4", *flags, env=env) as d:
        yield d, path


async def shown(d: DaemonProc, *args: str) -> str:
    """What `ddpctl ARGS` prints (a real client process, 200 columns wide)."""
    with anyio.fail_after(60):
        done = await anyio.run_process([DDPCTL, "--socket", str(d.socket), *args], check=False,
                                       stdin=subprocess.DEVNULL, env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 0, done.stderr.decode()
    return done.stdout.decode()


async def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    status, body = await _http_get(port, "/metrics")
    assert status == 200, body
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body) for s in family.samples}


async def test_a_subset_daemon_places_by_uuid_packs_fractions_and_names_gpus_alike(short_tmp: Path) -> None:
    gate = short_tmp / "gate"
    config = short_tmp / "ddpd.toml"
    config.write_text("metrics_public = true\n")
    flags = ("--config", str(config), "--metrics-listen", "127.0.0.1:0")
    async with fake_gpu_daemon(short_tmp, nvml_state(4), *flags, visible="2,3") as (d, _):
        port = next(e for e in d.logs if e.get("event") == "metrics.listening")["port"]
        info = await d.client.daemon_info()
        assert info.gpus == 2 and [(g.index, g.uuid) for g in info.gpu_devices] == [(2, UUIDS[2]), (3, UUIDS[3])]

        halves = await d.client.submit(gated(d, gate, nproc=2, gpus_per_rank=0.5, device="cpu"))
        await wait_waiting_at_gate(d, halves, ranks=2)
        whole = await d.client.submit(gated(d, gate, gpus_per_rank=1, device="cpu"))
        await wait_waiting_at_gate(d, whole)
        third = await d.client.submit(gated(d, gate, gpus_per_rank=0.5, device="cpu"))
        # both GPUs are held (2 wholly by two halves, 3 by one rank): the third waits
        assert (await d.client.status(third)).state == JobState.QUEUED

        seen = await rank_reports(d.client, halves)
        assert [seen[r]["CUDA_VISIBLE_DEVICES"] for r in (0, 1)] == [UUIDS[2], UUIDS[2]]  # physical GPU 2
        assert (await rank_reports(d.client, whole))[0]["CUDA_VISIBLE_DEVICES"] == UUIDS[3]

        # one name everywhere: NVML index and UUID, in status, `ddpctl daemon` and the metrics
        view = await d.client.status(halves)
        recent = [set(g.utilization) for r in view.ranks for g in r.gpus]
        assert recent == [{5}, {5}]  # the GPU's utilisation of the last minutes (NVML: 5%), then as placed
        assert [[replace(g, utilization=[]) for g in r.gpus] for r in view.ranks] == [
            [RankGpu(index=2, uuid=UUIDS[2], share=0.5)]] * 2
        assert f"2 {UUIDS[2][:12]} x0.5 (-)" in await shown(d, "status", halves)  # the UUID's first 8 hex digits
        info = await d.client.daemon_info()
        assert [(g.index, g.uuid, g.jobs, g.held) for g in info.gpu_devices] == [
            (2, UUIDS[2], [halves], 1.0), (3, UUIDS[3], [whole], 1.0)]
        grid = await shown(d, "daemon")
        assert "gpu 2" in grid and f"NVIDIA H200 {UUIDS[2]}: " in grid and "0 free of 2" in grid
        series = await _scrape(port)
        held = sorted(dict(k)["gpu"] + " " + dict(k)["uuid"] + " " + dict(k)["job_id"]
                      for (name, k), v in series.items() if name == "ddpd_gpu_job" and v == 1)
        assert held == [f"2 {UUIDS[2]} {halves}", f"3 {UUIDS[3]} {whole}"]
        assert not any(dict(k).get("gpu") in ("0", "1") for _, k in series)  # not the daemon's GPUs

        gate.touch()
        with anyio.fail_after(120):
            done = [await d.client.wait(j) for j in (halves, whole, third)]
        assert [j.state for j in done] == [JobState.SUCCEEDED] * 3
        assert (await rank_reports(d.client, third))[0]["CUDA_VISIBLE_DEVICES"] in UUIDS[2:]
        assert_nothing_left(done)


async def test_scripts_see_their_gpus_and_the_collective_timeout_and_cuda_less_gpu_jobs_fail_naming_why(
        short_tmp: Path) -> None:
    async with fake_gpu_daemon(short_tmp, nvml_state(2)) as (d, _):
        script = await d.run(d.spec(script=[str(SCRIPTS / "show_env.py")], nproc=2, gpus_per_rank=1, device="cpu"))
        assert script.state == JobState.SUCCEEDED, script.root_cause
        envs = {r: report["env"] for r, report in (await rank_reports(d.client, script.id)).items()}
        for rank, env in envs.items():
            assert env["CUDA_VISIBLE_DEVICES"] == f"{UUIDS[0]},{UUIDS[1]}"  # torchrun's layout
            assert env["DDPD_CUDA_DEVICES"] == str(rank)  # its own: cuda:LOCAL_RANK
            assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
            assert float(env["DDPD_COLLECTIVE_TIMEOUT"]) >= 600 + 60
            assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in env or "TORCH_NCCL_ASYNC_ERROR_HANDLING" in os.environ

        # a CPU script that gives no timeout joins with the daemon's, past its own hang diagnosis
        timed = await d.run(d.spec(script=[str(SCRIPTS / "show_timeout.py")], nproc=1, timeouts={"progress": 30}))
        assert timed.state == JobState.SUCCEEDED, timed.root_cause
        seen = (await rank_reports(d.client, timed.id))[0]
        assert seen["timeout"] == float(seen["env"]) >= 30 + 60  # not torch's 30 min default for gloo

        # device auto with GPUs given, on a torch without CUDA: no silent CPU run while holding GPUs
        cudaless = await d.run(d.spec(task="two-layer", nproc=1, gpus_per_rank=1, steps=2))
        assert cudaless.state == JobState.FAILED
        assert cudaless.root_cause is not None
        said = (cudaless.root_cause.message or "") + (cudaless.root_cause.traceback or "")
        assert "gave this rank GPUs" in said, said
        # this CPU wheel; on a CUDA build the stand-in's UUIDs name no real GPU
        assert "built without CUDA" in said or "cannot use CUDA" in said, said
        assert_nothing_left([script, timed, cudaless])


async def exited(pid: int) -> None:
    """Until the process has exited (its pidfd becomes readable; a zombie counts)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        await anyio.wait_readable(fd)
    finally:
        os.close(fd)


@asynccontextmanager
async def freezer(name: str) -> AsyncIterator[Path]:
    """A cgroup v1 freezer of the test's own (its processes cannot be killed while frozen); thawed,
    its processes awaited, and removed afterwards."""
    group = FREEZER / name
    group.mkdir()
    try:
        yield group
    finally:
        with anyio.CancelScope(shield=True), anyio.fail_after(30):
            (group / "freezer.state").write_text("THAWED")
            for pid in (group / "cgroup.procs").read_text().split():
                await exited(int(pid))
            group.rmdir()


@pytest.mark.skipif(not FREEZER.is_dir() or os.geteuid() != 0,
                    reason="needs the cgroup v1 freezer (a frozen process is unkillable)")
async def test_gpus_of_an_unkillable_rank_drain_before_the_next_job_gets_them(short_tmp: Path) -> None:
    gate = short_tmp / "gate"
    state = nvml_state(1)
    async with fake_gpu_daemon(short_tmp, state) as (d, path):
        stuck = await d.client.submit(gated(d, gate, gpus_per_rank=1, device="cpu", timeouts={"kill_grace": 1}))
        await wait_waiting_at_gate(d, stuck)
        pid = (await d.client.status(stuck)).ranks[0].pid
        assert pid is not None
        state["gpus"][0]["processes"] = [{"pid": pid, "memory": 1 << 30}]  # the driver lists it on the GPU
        write_state(path, state)
        async with freezer(f"ddpd-test-{os.getpid()}") as group:
            (group / "cgroup.procs").write_text(str(pid))
            (group / "freezer.state").write_text("FROZEN")
            await d.client.cancel(stuck)
            await d.wait_event(stuck, lambda e: e.kind == "rank.unkillable")
            draining = await d.wait_event(None, lambda e: e.kind == "job.gpus_draining" and e.job_id == stuck)
            assert draining.data["alive"] == [pid] and draining.data["listed"] == [pid]
            assert (await d.client.wait(stuck)).state == JobState.CANCELLED
            gate.touch()
            waiting = await d.client.submit(gated(d, gate, gpus_per_rank=1, device="cpu"))
            info = await d.client.daemon_info()
            assert [(g.jobs, g.draining) for g in info.gpu_devices] == [([], [stuck])]
            assert "draining: " + stuck in await shown(d, "daemon")
            assert (await d.client.status(waiting)).state == JobState.QUEUED
        # thawed: the rank dies of its pending SIGKILL, but NVML still lists it: still draining
        with anyio.fail_after(30):
            await exited(pid)
        assert (await d.client.status(waiting)).state == JobState.QUEUED
        state["gpus"][0]["processes"] = []
        write_state(path, state)
        await d.wait_event(None, lambda e: e.kind == "job.gpus_released" and e.job_id == stuck)
        await wait_state(d, waiting, "SUCCEEDED")
        with anyio.fail_after(60):
            done = [await d.client.status(j) for j in (stuck, waiting)]
        assert done[1].ranks[0].pid != pid
        assert_nothing_left(done)

