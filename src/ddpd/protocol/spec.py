"""The job spec: what a user submits, bounded and validated at the door with messages that name the field.

The types carry the static bounds (every integer within int64 or a tighter range, lengths of
strings, lists and maps); `check_spec` adds what types cannot say: cross-field rules, control
characters, reserved environment variables and finite numbers. Bounds that depend on the
daemon's configuration (the priority band, the largest kill grace, the machine's slots) are
checked by the daemon.
"""

from __future__ import annotations

import math
import os
import re
from typing import Annotated, Literal

import msgspec

from .nodes import MAX_NODES, check_run_id, parse_endpoint, parse_nnodes
from .timeouts import Timeouts
from .worker import is_reserved_env

BUILTIN_TASKS = frozenset({"two-layer", "mlp"})
_FACTORY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
PRIORITY_LIMIT = 2**31  # |priority| below this; the daemon's configured band is narrower
MAX_NPROC = 1024  # ranks of one job: more than one machine could ever run
MAX_WORLD = MAX_NODES * MAX_NPROC  # global ranks of a multi-node job: every node's ranks
MAX_NAME = 200
MAX_TASK = 200
MAX_PATH = 4096  # workdir and each script argument
MAX_ARGS = 256  # script path (or module) and its arguments
MAX_ENV = 256
MAX_ENV_KEY = 128
MAX_ENV_VALUE = 16 * 1024
MAX_OPTIONS = 64
MAX_NOTIFY = 2048  # characters of a notification command or URL
MAX_ENVIRON = 4096  # names the submitter exported (--export)
MAX_ENVIRON_VALUE = 128 * 1024
MAX_ENVIRON_TOTAL = 1 << 20  # bytes of names and values together (the request limit is tighter still)
MAX_EXPORT = 4096
MAX_OPTION_KEY = 64
MAX_OPTION_TEXT = 4096
MAX_AFTER = 32  # jobs one job may wait for (--after)
MAX_JOB_ID = 64
MIN_MEMORY = 1 << 20  # bytes: a job's memory limit is at least 1 MiB
MAX_MEMORY = 1 << 50
MAX_CPUS = 65536.0
DEFAULT_UMASK = 0o022  # a submit that does not say its umask: the usual shell's


def current_umask() -> int:
    """This process's umask, read without changing it (`os.umask` sets one to read it: a window in
    which another thread would create files with the wrong mode)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8) & 0o777
    except (OSError, ValueError, IndexError):
        pass
    old = os.umask(DEFAULT_UMASK)
    os.umask(old)
    return old & 0o777


Int64 = Annotated[int, msgspec.Meta(ge=INT64_MIN, le=INT64_MAX)]
OptionValue = Annotated[str, msgspec.Meta(max_length=MAX_OPTION_TEXT)] | Int64 | float | bool


class JobSpec(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A job as submitted. Exactly one of `task` and `script` says what each rank runs."""

    name: Annotated[str, msgspec.Meta(max_length=MAX_NAME)] = ""
    task: Annotated[str, msgspec.Meta(max_length=MAX_TASK)] | None = None
    script: Annotated[list[Annotated[str, msgspec.Meta(max_length=MAX_PATH)]],
                      msgspec.Meta(max_length=MAX_ARGS)] | None = None
    module: bool = False
    nproc: Annotated[int, msgspec.Meta(ge=1, le=MAX_NPROC)] = 1
    oversubscribe: bool = False  # more ranks than the daemon's CPU slots: run anyway, holding all of them
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # whole GPUs per rank, or a fraction of one GPU below 1 in thousandths (0.5: two ranks share a GPU)
    gpus_per_rank: Annotated[int, msgspec.Meta(ge=0, le=64)] | Annotated[float, msgspec.Meta(ge=0, le=64)] = 0
    steps: Annotated[int, msgspec.Meta(ge=0, le=10**9)] = 20
    seed: Int64 = 0
    timeouts: Timeouts = msgspec.field(default_factory=Timeouts)
    env: Annotated[dict[Annotated[str, msgspec.Meta(max_length=MAX_ENV_KEY)],
                        Annotated[str, msgspec.Meta(max_length=MAX_ENV_VALUE)]],
                   msgspec.Meta(max_length=MAX_ENV)] = msgspec.field(default_factory=dict)
    workdir: Annotated[str, msgspec.Meta(max_length=MAX_PATH)] | None = None
    max_restarts: Annotated[int, msgspec.Meta(ge=0, le=100)] = 0
    checkpoint_every: Annotated[int, msgspec.Meta(ge=0, le=10**9)] = 0
    # ranks that may die and be replaced in place while the others keep their state (built-in tasks;
    # None: DEFAULT_HOT_REPLACE on one node, 0 across nodes); separate from max_restarts
    hot_replace: Annotated[int, msgspec.Meta(ge=0, le=100)] | None = None
    priority: Annotated[int, msgspec.Meta(gt=-PRIORITY_LIMIT, lt=PRIORITY_LIMIT)] = 0
    # may be stopped (gracefully: agreed step, checkpoint) and requeued for a higher-priority job; on a
    # script it also says the script honours the stop API (ddpd.worker.api.should_stop)
    preemptible: bool = False
    options: Annotated[dict[Annotated[str, msgspec.Meta(max_length=MAX_OPTION_KEY)], OptionValue],
                       msgspec.Meta(max_length=MAX_OPTIONS)] = msgspec.field(default_factory=dict)
    # the submitter's interpreter and environment (Slurm's --export; ddpctl always sends them); None (a
    # spec that names none, as JobSpec of the Python API by default): the daemon's interpreter and environment
    python: Annotated[str, msgspec.Meta(max_length=MAX_PATH)] | None = None
    environ: Annotated[dict[Annotated[str, msgspec.Meta(max_length=MAX_ENV_KEY)],
                            Annotated[str, msgspec.Meta(max_length=MAX_ENVIRON_VALUE)]],
                       msgspec.Meta(max_length=MAX_ENVIRON)] | None = None
    export: Annotated[str, msgspec.Meta(max_length=MAX_EXPORT)] = ""  # ALL, NONE or the names, for display
    # multi-node (torchrun's flags): one job across the daemons of several nodes, formed by torch's
    # elastic rendezvous at rdzv_endpoint; an empty endpoint is the single-node job
    nnodes: Annotated[str, msgspec.Meta(max_length=32)] = "1"  # N or MIN:MAX
    rdzv_endpoint: Annotated[str, msgspec.Meta(max_length=300)] = ""  # HOST:PORT
    rdzv_id: Annotated[str, msgspec.Meta(max_length=128)] = ""
    rdzv_backend: Literal["c10d"] = "c10d"
    rdzv_keep_alive: Annotated[float, msgspec.Meta(ge=1, le=3600)] | None = None  # a silent node is lost
    rdzv_last_call: Annotated[float, msgspec.Meta(ge=0, le=3600)] | None = None  # wait after MIN nodes joined
    # jobs that must all have SUCCEEDED before this one starts (Slurm's afterok); the daemon stores
    # them as full ids, whatever prefix was submitted
    after: Annotated[list[Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_JOB_ID)]],
                     msgspec.Meta(max_length=MAX_AFTER)] = msgspec.field(default_factory=list)
    # jobs that must all have ended, however (Slurm's afterany), or ended otherwise than SUCCEEDED
    # (afternotok: a clean-up or a notification after a failure)
    after_any: Annotated[list[Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_JOB_ID)]],
                         msgspec.Meta(max_length=MAX_AFTER)] = msgspec.field(default_factory=list)
    after_notok: Annotated[list[Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_JOB_ID)]],
                           msgspec.Meta(max_length=MAX_AFTER)] = msgspec.field(default_factory=list)
    # limits of the attempt's cgroup (memory.max, cpu.max) where the daemon has those controllers;
    # reported as unavailable (event job.limits) where it has not
    memory: Annotated[int, msgspec.Meta(ge=MIN_MEMORY, le=MAX_MEMORY)] | None = None  # bytes
    cpus: Annotated[float, msgspec.Meta(gt=0, le=MAX_CPUS)] | None = None
    # bytes of each rank log before it rotates; at most the daemon's rank_log_max (None: that)
    log_max: Annotated[int, msgspec.Meta(ge=64 * 1024, le=1 << 50)] | None = None
    # when the job ends, restarts or is preempted: a shell command run as the submitter (in a cgroup of
    # its own, DDPD_JOB_* in its environment), and/or a URL POSTed the same as JSON (by the submitter)
    notify: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NOTIFY)] | None = None
    notify_url: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NOTIFY,
                                            pattern=r"^https?://[^\s]+$")] | None = None
    # the submitter's umask, which its ranks run with (as under torchrun from the same shell); sent by
    # ddpctl and the Python client; None (a raw submit without it): DEFAULT_UMASK
    umask: Annotated[int, msgspec.Meta(ge=0, le=0o777)] | None = None


class SpecError(ValueError):
    """A job spec that cannot run; `field` names the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


# set by the daemon for every rank (rank, rendezvous, marker and device variables): a spec cannot
# override them; the names are part of the worker contract
reserved_env = is_reserved_env


def check_text(field: str, value: str, limit: int) -> None:
    """Refuse control characters (NUL included) and text longer than `limit`, naming the field."""
    if len(value) > limit:
        raise SpecError(field, f"longer than {limit} characters")
    bad = _CONTROL.search(value)
    if bad is not None:
        raise SpecError(field, f"contains the control character {bad.group()!r} at position {bad.start()}")


def check_spec(spec: JobSpec) -> JobSpec:
    """Cross-field checks that types alone cannot express. Returns the spec with `task` filled in."""
    _check_texts(spec)
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
    spec = _check_gpus(spec)
    for key in spec.env:
        if not _ENV_NAME.match(key):
            raise SpecError(f"env.{key}", "not a valid environment variable name")
        if reserved_env(key):
            raise SpecError(f"env.{key}", "is set by the daemon for every rank and cannot be overridden")
    if spec.workdir is not None and not spec.workdir.startswith("/"):
        raise SpecError("workdir", f"must be an absolute path, got {spec.workdir!r}")
    if spec.python is not None and not spec.python.startswith("/"):
        raise SpecError("python", f"must be an absolute path to an interpreter, got {spec.python!r}")
    check_nodes(spec)
    if spec.hot_replace and spec.script is not None:
        raise SpecError("hot_replace", "applies to built-in tasks: an unmodified script cannot hand its model "
                                       "and optimizer to a replacement rank (see docs/hot-replace.md)")
    return spec


DEFAULT_HOT_REPLACE = 3  # replacements a built-in task's job allows unless it says otherwise


def hot_replacements(spec: JobSpec) -> int:
    """How many ranks of the job may be replaced in place (0: a lost rank restarts the attempt); a
    multi-node job's only when it asks (each node's daemon replaces its own ranks)."""
    if spec.script is not None:
        return 0
    if spec.hot_replace is None:
        return DEFAULT_HOT_REPLACE if spec.nnodes == "1" else 0
    return spec.hot_replace


GPU_SHARE = 1000  # one GPU in the unit fractions are packed in (thousandths)


def rank_gpus(gpus_per_rank: float) -> tuple[int, int]:
    """(devices each rank is given, thousandths of each it holds): k whole GPUs are (k, 1000), a
    fraction f below 1 is (1, f x 1000) on one shared GPU, no GPU is (0, 0)."""
    if gpus_per_rank <= 0:
        return 0, 0
    if gpus_per_rank >= 1:
        return int(gpus_per_rank), GPU_SHARE
    return 1, round(gpus_per_rank * GPU_SHARE)


def _check_gpus(spec: JobSpec) -> JobSpec:
    """gpus_per_rank is whole above 1 and counts in thousandths below; cuda (or nccl) without it is 1."""
    value = spec.gpus_per_rank
    if not math.isfinite(value):
        raise SpecError("gpus_per_rank", "must be a finite number")
    if value > 1 and value != int(value):
        raise SpecError("gpus_per_rank", f"{value:g}: above 1 it is a whole number of GPUs per rank")
    thousandths = value * GPU_SHARE
    if 0 < value < 1 and (abs(thousandths - round(thousandths)) > 1e-6 or round(thousandths) < 1):
        raise SpecError("gpus_per_rank", f"{value!r}: a fraction of a GPU counts in thousandths (0.5, 0.25, 0.125)")
    if value == int(value) and not isinstance(value, int):
        spec = msgspec.structs.replace(spec, gpus_per_rank=int(value))
    if value == 0 and (spec.device == "cuda" or spec.backend == "nccl"):
        spec = msgspec.structs.replace(spec, gpus_per_rank=1)
    return spec


def check_nodes(spec: JobSpec) -> None:
    """The multi-node fields: nnodes parses, and a multi-node job names its endpoint and run id."""
    try:
        _, hi = parse_nnodes(spec.nnodes)
    except ValueError as exc:
        raise SpecError("nnodes", str(exc)) from None
    if not spec.rdzv_endpoint:
        if hi > 1 or spec.rdzv_id:
            raise SpecError("rdzv_endpoint", "a multi-node job needs the rendezvous endpoint HOST:PORT")
        return
    try:
        parse_endpoint(spec.rdzv_endpoint)
    except ValueError as exc:
        raise SpecError("rdzv_endpoint", str(exc)) from None
    try:
        check_run_id(spec.rdzv_id)
    except ValueError as exc:
        raise SpecError("rdzv_id", str(exc)) from None


def dependency_ids(spec: JobSpec) -> list[str]:
    """Every job the spec waits for (`after`, `after_any`, `after_notok`), in that order."""
    return [*spec.after, *spec.after_any, *spec.after_notok]


def is_multinode(spec: JobSpec) -> bool:
    """A job formed across nodes by the rendezvous at `rdzv_endpoint` (else the single-node path)."""
    return bool(spec.rdzv_endpoint)


def _check_texts(spec: JobSpec) -> None:
    """Lengths and characters of every string a user gave (types bound them too, when decoded)."""
    check_text("name", spec.name, MAX_NAME)
    if spec.task is not None:
        check_text("task", spec.task, MAX_TASK)
    if spec.script is not None:
        if len(spec.script) > MAX_ARGS:
            raise SpecError("script", f"more than {MAX_ARGS} items")
        for i, arg in enumerate(spec.script):
            check_text(f"script[{i}]", arg, MAX_PATH)
    if spec.workdir is not None:
        check_text("workdir", spec.workdir, MAX_PATH)
    if len(spec.env) > MAX_ENV:
        raise SpecError("env", f"more than {MAX_ENV} variables")
    for key, value in spec.env.items():
        check_text(f"env.{key[:MAX_ENV_KEY]!r}", key, MAX_ENV_KEY)
        check_text(f"env.{key}", value, MAX_ENV_VALUE)
    if spec.python is not None:
        check_text("python", spec.python, MAX_PATH)
    check_text("export", spec.export, MAX_EXPORT)
    for field in ("notify", "notify_url"):
        if (text := getattr(spec, field)) is not None:
            check_text(field, text, MAX_NOTIFY)
    if spec.environ is not None:
        check_environ(spec.environ)
    if len(dependency_ids(spec)) > MAX_AFTER:
        raise SpecError("after", f"more than {MAX_AFTER} jobs")
    for field, deps in (("after", spec.after), ("after_any", spec.after_any), ("after_notok", spec.after_notok)):
        for i, dep in enumerate(deps):
            check_text(f"{field}[{i}]", dep, MAX_JOB_ID)
            if not dep:
                raise SpecError(f"{field}[{i}]", "an empty job id")
    if len(spec.options) > MAX_OPTIONS:
        raise SpecError("options", f"more than {MAX_OPTIONS} options")
    for key, option in spec.options.items():
        check_text(f"options.{key[:MAX_OPTION_KEY]!r}", key, MAX_OPTION_KEY)
        if isinstance(option, str):
            check_text(f"options.{key}", option, MAX_OPTION_TEXT)
        elif isinstance(option, float) and not math.isfinite(option):
            raise SpecError(f"options.{key}", f"must be a finite number, got {option}")
        elif isinstance(option, int) and not isinstance(option, bool) and not INT64_MIN <= option <= INT64_MAX:
            raise SpecError(f"options.{key}", "out of the 64-bit integer range")


def check_environ(environ: dict[str, str]) -> None:
    """The exported environment: names as a shell could export them, values without NUL, bounded.

    Values may hold newlines and other control characters (an exported shell function does);
    reserved names are not refused here: the daemon's values win over them at launch.
    """
    if len(environ) > MAX_ENVIRON:
        raise SpecError("environ", f"more than {MAX_ENVIRON} variables")
    total = 0
    for key, value in environ.items():
        if not key or "=" in key or "\0" in key or len(key) > MAX_ENV_KEY:
            raise SpecError(f"environ.{key[:MAX_ENV_KEY]!r}", "not an environment variable name")
        if "\0" in value:
            raise SpecError(f"environ.{key}", "contains a NUL character")
        if len(value) > MAX_ENVIRON_VALUE:
            raise SpecError(f"environ.{key}", f"longer than {MAX_ENVIRON_VALUE} characters")
        total += len(key) + len(value) + 2
    if total > MAX_ENVIRON_TOTAL:
        raise SpecError("environ", f"{total} bytes in all, more than {MAX_ENVIRON_TOTAL}")
