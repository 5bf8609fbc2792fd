"""Atomic checkpoints of the built-in loop: ``{model, optimizer, step}`` in ``checkpoint.pt``."""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch

CHECKPOINT_NAME = "checkpoint.pt"


def checkpoint_path(directory: str) -> str:
    return os.path.join(directory, CHECKPOINT_NAME)


def save_checkpoint(directory: str, model: Any, optimizer: Any, step: int) -> str:
    """Write to a temporary file in `directory`, fsync, then rename over ``checkpoint.pt``.

    A reader sees the previous checkpoint or the new one, never a torn file.
    """
    os.makedirs(directory, exist_ok=True)
    final = checkpoint_path(directory)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".checkpoint-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return final


def load_checkpoint(directory: str, model: Any, optimizer: Any, device: Any) -> int:
    """Load ``checkpoint.pt`` from `directory` into `model` and `optimizer`; return its step (0: none)."""
    if not directory:
        return 0
    path = checkpoint_path(directory)
    if not os.path.exists(path):
        return 0
    state = torch.load(path, map_location=device, weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["step"])
