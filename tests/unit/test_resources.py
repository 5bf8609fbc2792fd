"""Resource accounting: GPU devices by UUID and in shares, CPU slots; a job takes all it needs or waits."""

from __future__ import annotations

import msgspec
import pytest

from ddpd.daemon.gpu.gpus import GpuInfo
from ddpd.daemon.gpu.layout import job_entries, own_entries, rank_visible
from ddpd.daemon.queue.resources import Resources
from ddpd.protocol import JobSpec, SpecError, check_spec
from ddpd.protocol.spec import rank_gpus


def devices(n: int) -> list[GpuInfo]:
    return [GpuInfo(index=i, name="H200", uuid=f"GPU-{i}{i}{i}", memory_total=1, memory_used=0, utilization=0,
                    source="nvml") for i in range(n)]


def gpu_spec(nproc: int, per_rank: float, script: list[str] | None = None) -> JobSpec:
    return check_spec(JobSpec(task=None if script else "two-layer", script=script, nproc=nproc,
                              gpus_per_rank=per_rank, device="cpu"))


def test_cpu_jobs_take_and_give_back_slots() -> None:
    res = Resources(gpus=0, cpu_slots=4)
    spec = JobSpec(task="two-layer", nproc=3)
    assert res.take(spec) == []
    assert res.busy_cpu() == 3
    assert res.take(JobSpec(task="two-layer", nproc=2)) is None  # only 1 slot left: waits
    res.give_back(spec, [])
    assert res.busy_cpu() == 0 and res.free_cpu == 4


def test_gpu_jobs_get_devices_by_uuid_and_no_cpu_slots() -> None:
    res = Resources(devices(4), cpu_slots=2)
    spec = gpu_spec(2, 1)
    first = res.take(spec)
    second = res.take(spec)
    assert first == ["GPU-000", "GPU-111"] and second == ["GPU-222", "GPU-333"]
    assert res.take(spec) is None
    assert res.free_cpu == 2
    res.give_back(spec, first or [])
    assert res.free_gpus == ["GPU-000", "GPU-111"]


def test_a_configured_count_without_nvml_names_devices_by_position() -> None:
    res = Resources(gpus=2, cpu_slots=1)
    assert res.take(gpu_spec(2, 1)) == ["0", "1"]


def test_fractions_pack_onto_the_fullest_gpu_that_has_room() -> None:
    res = Resources(devices(2), cpu_slots=1)
    half = gpu_spec(2, 0.5)
    assert res.take(half) == ["GPU-000", "GPU-000"]  # two ranks share one GPU
    assert res.held_share("GPU-000") == 1.0 and res.free_gpus == ["GPU-111"]
    quarter = gpu_spec(1, 0.25)
    assert res.take(quarter) == ["GPU-111"]
    assert res.take(gpu_spec(3, 0.25)) == ["GPU-111"] * 3  # fills GPU 1 before spreading
    assert res.take(quarter) is None
    assert res.take(gpu_spec(1, 1)) is None  # no GPU is wholly free
    res.give_back(half, ["GPU-000", "GPU-000"])
    assert res.take(gpu_spec(1, 1)) == ["GPU-000"]


def test_a_job_that_does_not_fit_takes_nothing() -> None:
    res = Resources(devices(2), cpu_slots=1)
    assert res.take(gpu_spec(1, 0.5)) == ["GPU-000"]
    assert res.take(gpu_spec(3, 1)) is None
    assert res.free_share == {"GPU-000": 500, "GPU-111": 1000}


def test_draining_devices_stay_held_until_given_back() -> None:
    res = Resources(devices(1), cpu_slots=1)
    spec = gpu_spec(1, 1)
    taken = res.take(spec) or []
    res.hold("j1", taken)
    assert res.draining == {"j1": ["GPU-000"]} and res.take(spec) is None
    res.give_back(spec, taken, "j1")
    assert res.draining == {} and res.take(spec) == ["GPU-000"]


def test_can_ever_fit_names_what_is_missing() -> None:
    res = Resources(devices(1), cpu_slots=2)
    assert res.can_ever_fit(JobSpec(task="two-layer", nproc=2)) is None
    problem = res.can_ever_fit(JobSpec(task="two-layer", nproc=3))
    assert problem is not None and "CPU slots" in problem
    problem = res.can_ever_fit(gpu_spec(2, 1))
    assert problem is not None and "needs 2 GPUs" in problem
    assert res.can_ever_fit(gpu_spec(2, 0.5)) is None  # two halves on the one GPU
    problem = res.can_ever_fit(gpu_spec(3, 0.5))
    assert problem is not None and "needs 2 GPUs (3 ranks x 0.5)" in problem


def test_resize_keeps_what_running_jobs_hold() -> None:
    res = Resources(gpus=0, cpu_slots=4)
    spec = JobSpec(task="two-layer", nproc=3)
    res.take(spec)
    res.resize_cpu(2)  # shrunk below what runs: nothing new starts until slots come back
    assert res.free_cpu == -1 and res.busy_cpu() == 3
    res.give_back(spec, [])
    assert res.free_cpu == 2 and res.total_cpu == 2


@pytest.mark.parametrize(("value", "expected"), [(0, (0, 0)), (1, (1, 1000)), (3, (3, 1000)), (0.5, (1, 500)),
                                                 (0.125, (1, 125))])
def test_gpus_per_rank_is_whole_gpus_or_thousandths_of_one(value: float, expected: tuple[int, int]) -> None:
    assert rank_gpus(value) == expected


@pytest.mark.parametrize(("value", "message"), [(1.5, "whole number"), (0.3333, "thousandths"),
                                                (0.0001, "thousandths")])
def test_a_gpu_count_that_cannot_be_packed_is_refused_at_the_door(value: float, message: str) -> None:
    with pytest.raises(SpecError, match=message) as refused:
        gpu_spec(1, value)
    assert refused.value.field == "gpus_per_rank"


def test_whole_floats_become_ints_and_nccl_or_cuda_imply_one_gpu() -> None:
    assert isinstance(gpu_spec(1, 2.0).gpus_per_rank, int)
    assert check_spec(JobSpec(task="two-layer", backend="nccl")).gpus_per_rank == 1
    assert check_spec(JobSpec(task="two-layer", device="cuda")).gpus_per_rank == 1
    decoded = msgspec.json.decode(b'{"gpus_per_rank": 0.5}', type=JobSpec)
    assert decoded.gpus_per_rank == 0.5
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"gpus_per_rank": -0.5}', type=JobSpec)


def test_rank_layout_built_in_tasks_see_their_own_scripts_see_the_jobs() -> None:
    gpus = ["GPU-a", "GPU-b", "GPU-c", "GPU-d"]
    task, script = gpu_spec(2, 2), gpu_spec(2, 2, script=["x.py"])
    assert own_entries(gpus, task, 1) == ["GPU-c", "GPU-d"]
    assert rank_visible(gpus, task, 1) == ("GPU-c,GPU-d", "0,1")
    # torchrun's layout: rank 1 sees all four; its own are cuda:2 and cuda:3, not cuda:1
    assert rank_visible(gpus, script, 1) == ("GPU-a,GPU-b,GPU-c,GPU-d", "2,3")
    shared = ["GPU-a", "GPU-a", "GPU-b", "GPU-b"]
    assert job_entries(shared) == ["GPU-a", "GPU-b"]
    assert rank_visible(shared, gpu_spec(4, 0.5, script=["x.py"]), 3) == ("GPU-a,GPU-b", "1")
    assert rank_visible(shared, gpu_spec(4, 0.5), 1) == ("GPU-a", "0")
    assert rank_visible([], JobSpec(task="two-layer"), 0) == ("", "")
