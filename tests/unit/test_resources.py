"""Resource accounting: GPUs by index, CPU slots, a job takes all it needs or waits."""

from __future__ import annotations

from ddpd.daemon.queue.resources import Resources
from ddpd.protocol import JobSpec


def test_cpu_jobs_take_and_give_back_slots() -> None:
    res = Resources(gpus=0, cpu_slots=4)
    spec = JobSpec(task="two-layer", nproc=3)
    assert res.take(spec) == []
    assert res.busy_cpu() == 3
    assert res.take(JobSpec(task="two-layer", nproc=2)) is None  # only 1 slot left: waits
    res.give_back(spec, [])
    assert res.busy_cpu() == 0 and res.free_cpu == 4


def test_gpu_jobs_get_indices_and_no_cpu_slots() -> None:
    res = Resources(gpus=4, cpu_slots=2)
    spec = JobSpec(task="two-layer", nproc=2, gpus_per_rank=1, device="cuda")
    first = res.take(spec)
    second = res.take(spec)
    assert first == [0, 1] and second == [2, 3]
    assert res.take(spec) is None
    assert res.free_cpu == 2
    res.give_back(spec, first)
    assert res.free_gpus == [0, 1]


def test_can_ever_fit_names_what_is_missing() -> None:
    res = Resources(gpus=1, cpu_slots=2)
    assert res.can_ever_fit(JobSpec(task="two-layer", nproc=2)) is None
    problem = res.can_ever_fit(JobSpec(task="two-layer", nproc=3))
    assert problem is not None and "CPU slots" in problem
    problem = res.can_ever_fit(JobSpec(task="two-layer", nproc=2, gpus_per_rank=1, device="cuda"))
    assert problem is not None and "GPUs" in problem


def test_resize_keeps_what_running_jobs_hold() -> None:
    res = Resources(gpus=0, cpu_slots=4)
    spec = JobSpec(task="two-layer", nproc=3)
    res.take(spec)
    res.resize_cpu(2)  # shrunk below what runs: nothing new starts until slots come back
    assert res.free_cpu == -1 and res.busy_cpu() == 3
    res.give_back(spec, [])
    assert res.free_cpu == 2 and res.total_cpu == 2
