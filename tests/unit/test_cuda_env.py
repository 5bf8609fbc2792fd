"""A rank given GPUs must be able to use CUDA (it names why not), nccl needs GPUs, a fraction of a GPU
counts against a user's limit as a fraction, and script mode passes the daemon's collective timeout."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch

from ddpd.daemon.config import Config
from ddpd.daemon.queue.admission import admit, over_user_gpus
from ddpd.daemon.queue.resources import Resources
from ddpd.daemon.store.records import Job
from ddpd.protocol import JobSpec, JobState, SpecError
from ddpd.worker.loop import cuda_unavailable, env_collective_timeout, require_cuda
from ddpd.worker.script import default_timeout


@pytest.mark.skipif(torch.version.cuda is not None, reason="a CPU-only torch")
def test_a_rank_given_gpus_on_a_cpu_only_torch_fails_naming_the_cause(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-1234")
    assert "built without CUDA" in (cuda_unavailable() or "")
    with pytest.raises(RuntimeError, match=r"gave this rank GPUs \(CUDA_VISIBLE_DEVICES='GPU-1234'\).*without CUDA"):
        require_cuda(JobSpec(task="two-layer", gpus_per_rank=1))
    require_cuda(JobSpec(task="two-layer", gpus_per_rank=1, device="cpu"))  # the job's explicit choice
    require_cuda(JobSpec(task="two-layer"))  # a CPU job


@pytest.mark.anyio
async def test_nccl_is_refused_on_a_daemon_without_gpus(tmp_path: Path) -> None:
    config = Config(state_dir=tmp_path)
    with pytest.raises(SpecError, match="nccl needs GPUs") as refused:
        await admit(JobSpec(task="two-layer", backend="nccl"), config, Resources(0, 4))
    assert refused.value.field == "backend"
    admitted = await admit(JobSpec(task="two-layer", backend="nccl"), config, Resources(1, 4))
    assert admitted.gpus_per_rank == 1


def test_half_gpus_count_as_halves_against_a_users_limit() -> None:
    def job(uid: int, nproc: int, per_rank: float) -> Job:
        spec = JobSpec(task="two-layer", nproc=nproc, gpus_per_rank=per_rank, device="cuda")
        return Job(id=f"j{uid}-{nproc}", seq=1, name="x", owner_uid=uid, spec=spec, state=JobState.RUNNING,
                   submitted_at=0.0)

    config = Config(max_gpus_per_user=1)
    assert not over_user_gpus(config, [job(1000, 1, 0.5)], job(1000, 1, 0.5))  # 0.5 + 0.5 = 1
    assert over_user_gpus(config, [job(1000, 2, 0.5)], job(1000, 1, 0.5))


def test_script_mode_passes_the_daemons_collective_timeout_unless_the_script_gives_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDPD_COLLECTIVE_TIMEOUT", "735")
    assert env_collective_timeout() == 735.0
    assert default_timeout(("gloo",), {}) == {"timeout": timedelta(seconds=735)}
    own = {"timeout": timedelta(seconds=5)}
    assert default_timeout(("gloo",), own) == own
    assert default_timeout(("gloo", "env://", timedelta(seconds=5)), {}) == {}  # given positionally
    for bad in ("", "nan", "-1", "soon"):
        monkeypatch.setenv("DDPD_COLLECTIVE_TIMEOUT", bad)
        assert env_collective_timeout() is None and default_timeout(("gloo",), {}) == {}
