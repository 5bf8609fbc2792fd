"""What `ddpctl daemon` and `status` show of the GPUs: NVML's process lists mapped onto jobs and
ranks, the text they are shown as, and a daemon without NVML (pure logic; no GPU needed)."""

from __future__ import annotations

import anyio
import pytest

from ddpd.cli.daemon_view import daemon_grid, gpu_line, rank_gpu_text
from ddpd.cli.render import ranks_table
from ddpd.cli.words import size_text
from ddpd.client import DaemonInfo, GpuView, JobSpec, JobState, RankGpu
from ddpd.daemon.gpu import gpus
from ddpd.daemon.gpu.gpus import GpuInfo, GpuProcess
from ddpd.daemon.gpu.gpuview import daemon_gpus, gpu_views, holders, rank_memory, with_rank_gpus
from ddpd.daemon.queue.resources import Resources
from ddpd.daemon.store.records import Job, Rank

GIB = 1 << 30


def dev(index: int, uuid: str = "") -> GpuInfo:
    return GpuInfo(index=index, name="H200", uuid=uuid or f"GPU-{index}aaa", memory_total=140 * GIB,
                   memory_used=3 * GIB, utilization=45, source="nvml")


def job(job_id: str, gpu_ids: list[str], pids: list[int], per_rank: float = 1) -> Job:
    j = Job(id=job_id, seq=1, name="", owner_uid=1000,
            spec=JobSpec(task="two-layer", nproc=len(pids), device="cuda", gpus_per_rank=per_rank),
            state=JobState.RUNNING, submitted_at=0.0, gpus=gpu_ids)
    j.ranks = [Rank(rank=r, attempt=1, pid=pid) for r, pid in enumerate(pids)]
    return j


def test_a_ranks_memory_is_what_its_own_pid_holds() -> None:
    d0, d1 = dev(0), dev(1)
    procs = {d0.entry: [GpuProcess(pid=10, memory_used=GIB), GpuProcess(pid=99, memory_used=5 * GIB)],
             d1.entry: [GpuProcess(pid=10, memory_used=None)]}
    assert rank_memory([d0], 10, procs, [d0, d1]) == [RankGpu(index=0, memory_used=GIB, uuid="GPU-0aaa"),
                                                     RankGpu(index=1, memory_used=None, uuid="GPU-1aaa")]
    assert rank_memory([d1], 11, procs, [d0, d1]) == [RankGpu(index=1, uuid="GPU-1aaa")]  # not on it yet
    assert rank_memory([d0], None, {}, [], share=0.5) == [RankGpu(index=0, uuid="GPU-0aaa", share=0.5)]


def test_a_gpu_is_held_by_the_job_given_it_and_by_a_job_whose_rank_is_on_it() -> None:
    a, b = job("j1", ["GPU-0aaa"], [10]), job("j2", ["GPU-1aaa"], [20])
    procs = {"GPU-0aaa": [GpuProcess(10, GIB), GpuProcess(20, GIB), GpuProcess(777, GIB)]}
    assert holders("GPU-0aaa", [a, b], procs) == (["j1", "j2"], 1)
    assert holders("GPU-1aaa", [a, b], procs) == (["j2"], 0)
    res = Resources([dev(0), dev(1)], cpu_slots=1)
    res.free_share["GPU-0aaa"] = 500
    res.hold("j0", ["GPU-0aaa"])
    views = gpu_views([dev(0)], [a, b], procs, res)
    assert views == [GpuView(index=0, name="H200", memory_total=140 * GIB, memory_used=3 * GIB, utilization=45,
                             jobs=["j1", "j2"], other_processes=1, uuid="GPU-0aaa", held=0.5, draining=["j0"])]


def test_sizes_and_lines_read_as_a_person_would_write_them() -> None:
    assert size_text(512) == "512 B" and size_text(3 * GIB // 2) == "1.5 GiB" and size_text(1536 * 1024) == "1.5 MiB"
    assert rank_gpu_text([RankGpu(0, GIB, uuid="GPU-x"), RankGpu(1)]) == "0 GPU-x (1.0 GiB), 1 (-)"
    # in the rank table a UUID is its first 8 hex digits (a prefix CUDA_VISIBLE_DEVICES takes too)
    mig = "MIG-5d3f0a1b-0000-1111-2222-333344445555"
    assert rank_gpu_text([RankGpu(2, None, uuid=mig, mig=1, share=0.5)]) == "2/mig1 MIG-5d3f0a1b x0.5 (-)"
    g = GpuView(index=0, name="H200", memory_total=140 * GIB, memory_used=GIB, utilization=7, jobs=["j1"],
                other_processes=2, uuid="GPU-x", held=0.5, draining=["j0"])
    assert gpu_line(g) == "H200 GPU-x: 1.0 GiB of 140.0 GiB, 7% busy; j1 (50% held) (+2 other processes); draining: j0"
    assert gpu_line(GpuView(index=1, name="H200", memory_total=GIB, memory_used=0)).endswith("0 B of 1.0 GiB; free")
    assert gpu_line(GpuView(index=1, name="GPU", memory_total=None, memory_used=None)) == "GPU: ?; free"


def _text(renderable: object) -> str:
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(renderable)
    return console.export_text()


def test_the_daemon_view_shows_each_gpu_or_why_there_are_no_figures() -> None:
    info = DaemonInfo(version="1", protocol=1, pid=1, uptime=1.0, socket="s", state_dir="d", running=1, queued=0,
                      cpu_slots=2, gpus=1, gpu_devices=[GpuView(index=0, name="H200", memory_total=GIB,
                                                                memory_used=GIB // 2, jobs=["j1"], uuid="GPU-x")])
    assert "gpu 0" in (text := _text(daemon_grid(info))) and "H200 GPU-x: 512.0 MiB of 1.0 GiB; j1" in text
    info.gpu_devices, info.gpu_note = [], "NVML init failed: no driver"
    assert "unavailable: NVML init failed" in _text(daemon_grid(info))


def test_status_shows_each_ranks_gpu_column_only_for_gpu_jobs() -> None:
    j = job("j1", ["GPU-0aaa", "GPU-1aaa"], [10, 11])
    view = j.view()
    assert "gpu" not in _text(ranks_table(view)).splitlines()[1]
    view.ranks[0].gpus = [RankGpu(0, GIB, uuid="GPU-0aaa")]
    assert "0 GPU-0aaa (1.0 GiB)" in _text(ranks_table(view))


@pytest.mark.anyio
async def test_without_nvml_the_views_have_no_figures_and_say_why(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing() -> list[GpuInfo]:
        raise gpus.NvmlUnavailable("nvidia-ml-py is not installed")

    def no_processes(gpu: GpuInfo) -> list[GpuProcess]:
        raise gpus.NvmlUnavailable("nvidia-ml-py is not installed")

    monkeypatch.setattr("ddpd.daemon.gpu.gpuview.nvml_discover", missing)
    monkeypatch.setattr("ddpd.daemon.gpu.gpuview.processes", no_processes)
    res = Resources(2, cpu_slots=1)
    j = job("j1", ["0", "1"], [10, 11])
    with anyio.fail_after(10):
        views, note = await daemon_gpus([j], res)
        view = await with_rank_gpus(j.view(), j, res)
    assert note == "nvidia-ml-py is not installed"
    assert [(v.index, v.jobs, v.memory_total) for v in views] == [(0, ["j1"], None), (1, ["j1"], None)]
    assert [r.gpus for r in view.ranks] == [[RankGpu(0)], [RankGpu(1)]]
    half = job("j2", ["0", "0"], [10, 11], per_rank=0.5)
    view = await with_rank_gpus(half.view(), half, res)
    assert [r.gpus for r in view.ranks] == [[RankGpu(0, share=0.5)], [RankGpu(0, share=0.5)]]
