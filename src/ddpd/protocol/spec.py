"""The job spec: what a user submits, validated at the door with messages that name the field."""

from __future__ import annotations

import re
from typing import Annotated, Literal

import msgspec

BUILTIN_TASKS = frozenset({"two-layer", "mlp"})
_FACTORY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

Seconds = Annotated[float, msgspec.Meta(gt=0, le=7 * 24 * 3600)]


class Timeouts(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Per-job timeouts in seconds; None takes the daemon's default."""

    join: Seconds | None = None
    heartbeat: Seconds | None = None
    progress: Seconds | None = None
    wall: Seconds | None = None
    kill_grace: Seconds | None = None
    stop_warning: Seconds | None = None


class JobSpec(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A job as submitted. Exactly one of `task` and `script` says what each rank runs."""

    name: Annotated[str, msgspec.Meta(max_length=200)] = ""
    task: str | None = None
    script: list[str] | None = None
    module: bool = False
    nproc: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 1
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    gpus_per_rank: Annotated[int, msgspec.Meta(ge=0, le=64)] = 0
    steps: Annotated[int, msgspec.Meta(ge=0, le=10**9)] = 20
    seed: int = 0
    timeouts: Timeouts = msgspec.field(default_factory=Timeouts)
    env: dict[str, str] = msgspec.field(default_factory=dict)
    workdir: str | None = None
    max_restarts: Annotated[int, msgspec.Meta(ge=0, le=100)] = 0
    checkpoint_every: Annotated[int, msgspec.Meta(ge=0)] = 0
    priority: int = 0
    options: dict[str, str | int | float | bool] = msgspec.field(default_factory=dict)


class SpecError(ValueError):
    """A job spec that cannot run; `field` names the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def check_spec(spec: JobSpec) -> JobSpec:
    """Cross-field checks that types alone cannot express. Returns the spec with `task` filled in."""
    if spec.task is not None and spec.script is not None:
        raise SpecError("task", "give either a task or a script, not both")
    if spec.script is not None:
        if not spec.script or not spec.script[0]:
            raise SpecError("script", "the script path (or module with module=true) is missing")
    elif spec.task is None:
        spec = msgspec.structs.replace(spec, task="two-layer")
    if spec.task is not None and spec.task not in BUILTIN_TASKS and not _FACTORY.match(spec.task):
        raise SpecError(
            "task",
            f"unknown task {spec.task!r}: use a built-in ({', '.join(sorted(BUILTIN_TASKS))}) "
            "or 'package.module:factory'",
        )
    if spec.backend == "nccl" and spec.device == "cpu":
        raise SpecError("backend", "nccl needs CUDA devices; use gloo with device=cpu")
    if spec.device == "cuda" and spec.gpus_per_rank == 0:
        spec = msgspec.structs.replace(spec, gpus_per_rank=1)
    for key in spec.env:
        if not _ENV_NAME.match(key):
            raise SpecError(f"env.{key}", "not a valid environment variable name")
    if spec.workdir is not None and not spec.workdir.startswith("/"):
        raise SpecError("workdir", f"must be an absolute path, got {spec.workdir!r}")
    return spec
