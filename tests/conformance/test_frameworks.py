"""Training frameworks' own DDP paths run by torchrun and by ddpd (pooled and cold ranks) end the same:
PyTorch Lightning (`strategy="ddp"`, which detects the elastic launcher and does not spawn), HF
`Trainer` on a tiny config-built GPT-2, `accelerate.Accelerator(cpu=True)` and pytorch-ignite's
`idist.Parallel("gloo")`: the same exit status, RESULT lines (losses, checksums, steps), checkpoint
and safetensors bytes, and nothing left behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from .harness import Daemons, assert_conform, launch_all, need

pytestmark = [pytest.mark.anyio, pytest.mark.conformance, pytest.mark.xdist_group("conformance")]


async def test_lightning_ddp_and_its_checkpoint(daemons: Daemons, tmp_path: Path) -> None:
    need("lightning")
    outcomes = await launch_all(daemons, tmp_path, "lightning_ddp.py")
    assert outcomes["torchrun"].status == 0, outcomes["torchrun"].output
    assert set(outcomes["torchrun"].files) == {"lightning.ckpt"}
    assert_conform(outcomes)


async def test_hf_trainer_and_save_pretrained(daemons: Daemons, tmp_path: Path) -> None:
    need("transformers")
    outcomes = await launch_all(daemons, tmp_path, "hf_trainer.py")
    assert outcomes["torchrun"].status == 0, outcomes["torchrun"].output
    assert "model/model.safetensors" in outcomes["torchrun"].files
    assert_conform(outcomes)


async def test_accelerate_on_cpu(daemons: Daemons, tmp_path: Path) -> None:
    need("accelerate")
    outcomes = await launch_all(daemons, tmp_path, "accelerate_cpu.py")
    assert outcomes["torchrun"].status == 0, outcomes["torchrun"].output
    assert "accelerate/model.safetensors" in outcomes["torchrun"].files
    assert_conform(outcomes)


async def test_ignite_parallel_gloo(daemons: Daemons, tmp_path: Path) -> None:
    need("ignite")
    outcomes = await launch_all(daemons, tmp_path, "ignite_parallel.py")
    assert outcomes["torchrun"].status == 0, outcomes["torchrun"].output
    assert set(outcomes["torchrun"].files) == {"ignite.pt"}
    assert_conform(outcomes)
