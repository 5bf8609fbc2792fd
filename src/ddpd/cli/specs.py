"""`ddpctl submit`'s options and the JobSpec they build (checked as the daemon checks it).

Relative paths mean what they mean in the submitter's shell: the working directory defaults to
ddpctl's own, and a script path that names a file here is made absolute.

The ranks run as they would from this shell (Slurm's `--export`): the interpreter ddpctl runs
under (`sys.executable`, or `--python PATH`) and the environment `--export` selects (`ALL`, the
default; `NONE`; or a comma-separated list of names), with `--env K=V` on top.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import click
import msgspec

from ddpd.client import BUILTIN_TASKS, JobSpec, Timeouts, build_spec, current_umask

F = TypeVar("F", bound=Callable[..., Any])

_NUMBER = re.compile(r"^[+-]?(\d+\.\d*|\.\d+|\d+)([eE][+-]?\d+)?$")

# click's name of each timeout option: its key (Timeouts declares the keys, bounds, flags and help)
_TIMEOUTS = {key.flag[2:].replace("-", "_"): name for name, key in Timeouts.keys().items()}
ENVIRON_BUDGET = 48 * 1024  # bytes of the exported environment: a submit request is at most 64 KiB
_PLAIN = ("name", "task", "nproc", "oversubscribe", "backend", "device", "gpus_per_rank", "steps", "seed",
          "max_restarts", "hot_replace", "checkpoint_every", "priority", "cpus", "log_max", "nnodes", "rdzv_endpoint",
          "rdzv_id",
          "rdzv_backend", "rdzv_keep_alive", "rdzv_last_call", "notify", "notify_url", "preemptible")
_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """A memory size as `--mem` takes it: bytes, or K, M, G, T (powers of 1024), e.g. 512M, 8G, 1.5GiB."""
    match = _SIZE.match(text.strip())
    if match is None:
        raise click.BadParameter(f"expected a size such as 512M or 8G, got {text!r}", param_hint="--mem")
    number, unit = match.groups()
    return int(float(number) * 1024 ** " KMGT".index(unit.upper() or " "))


def typed_value(text: str) -> str | int | float | bool:
    """A task option's value: true/false, an int, a float, else the text."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    if re.fullmatch(r"[+-]?\d+", text):
        return int(text)
    if _NUMBER.match(text):
        return float(text)
    return text


def pairs(param: str, values: tuple[str, ...]) -> list[tuple[str, str]]:
    result = []
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"expected KEY=VALUE, got {item!r}", param_hint=param)
        result.append((key, value))
    return result


def _seconds(name: str, help: str) -> Callable[[F], F]:
    return click.option(name, type=float, default=None, metavar="S", help=help)


_OPTIONS: list[Callable[[F], F]] = [
    click.option(
        "--task",
        default=None,
        help=f"Built-in task ({', '.join(sorted(BUILTIN_TASKS))}) or package.module:factory "
        "[default: two-layer, unless a script is given].",
    ),
    click.option("--nproc", "--nproc-per-node", "nproc", type=int, default=None,
                 help="Number of ranks (on this node) [default: 1]."),
    click.option("--oversubscribe", is_flag=True, default=None,
                 help="Run even with more ranks than the daemon's CPU slots (cpu_slots): they share cores."),
    click.option("--nnodes", default=None, metavar="N|MIN:MAX",
                 help="Nodes of a multi-node job (torchrun's flag); one submit per node [default: 1]."),
    click.option("--rdzv-endpoint", "rdzv_endpoint", default=None, metavar="HOST:PORT",
                 help="The multi-node rendezvous; the daemon on HOST serves it on PORT."),
    click.option("--rdzv-id", "rdzv_id", default=None, metavar="ID", help="The run id, the same on every node."),
    click.option("--rdzv-backend", "rdzv_backend", type=click.Choice(["c10d"]), default=None),
    _seconds("--rdzv-keep-alive", "Seconds a node may be silent before it counts as lost."),
    _seconds("--rdzv-last-call", "Seconds the rendezvous waits for more nodes once MIN have joined."),
    click.option("--name", default=None, help="A name for the job."),
    click.option("--backend", type=click.Choice(["auto", "gloo", "nccl"]), default=None),
    click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default=None),
    click.option("--gpus-per-rank", type=float, default=None, metavar="N",
                 help="GPUs per rank: a whole number, or a fraction below 1 (0.5: two ranks share a GPU)."),
    click.option("--steps", type=int, default=None, metavar="N", help="Training steps of a built-in task."),
    click.option("--seed", type=int, default=None, metavar="N"),
    *(_seconds(key.flag, key.help) for key in Timeouts.keys().values()),
    click.option("--max-restarts", type=int, default=None, metavar="N"),
    click.option("--hot-replace", type=int, default=None, metavar="N",
                 help="Ranks of a built-in task that may die and be replaced in place while the others keep "
                 "training (default 3; 0: a lost rank restarts the attempt)."),
    click.option("--checkpoint-every", type=int, default=None, metavar="N", help="Checkpoint every N steps."),
    click.option("--priority", type=int, default=None, metavar="N",
                 help="Higher runs first (default 0; within one priority, fair share, then submission). Lower is "
                 "anyone's choice; above your ceiling (0 unless the operator granted more) is refused."),
    click.option("--preemptible", is_flag=True, default=None,
                 help="A job of higher priority may stop this one (at an agreed step, checkpointed) and requeue it; "
                 "on a script, says it honours the stop API (ddpd.worker.api.should_stop)."),
    click.option("--mem", "mem", default=None, metavar="SIZE",
                 help="Memory limit of the job's cgroup (512M, 8G), where the daemon has the memory controller."),
    click.option("--cpus", type=float, default=None, metavar="N",
                 help="CPU limit of the job's cgroup (1.5 = one and a half cores), where the daemon has the cpu "
                 "controller."),
    click.option("--notify", default=None, metavar="CMD",
                 help="A shell command run as you when the job ends, restarts or is preempted (DDPD_JOB_ID, "
                 "DDPD_JOB_STATE, DDPD_JOB_ROOT_CAUSE, DDPD_JOB_DURATION, DDPD_JOB_LAST_LOSS... in its environment)."),
    click.option("--notify-url", "notify_url", default=None, metavar="URL",
                 help="A URL that gets the same as a JSON POST (http or https)."),
    click.option("--log-max", "log_max", type=int, default=None, metavar="BYTES",
                 help="Rotate each rank log past this size, keeping the newest [default and most: the daemon's]."),
    click.option("--env", "env", multiple=True, metavar="K=V", help="Environment variable for every rank."),
    click.option(
        "--workdir",
        type=click.Path(file_okay=False, path_type=Path),
        default=None,
        metavar="DIR",
        help="Working directory of every rank; relative scripts and task modules are found there "
        "[default: the current directory].",
    ),
    click.option(
        "--python",
        "python",
        type=click.Path(dir_okay=False, path_type=Path),
        default=None,
        metavar="PATH",
        help="Interpreter every rank runs; it must import torch and ddpd [default: the one running ddpctl].",
    ),
    click.option(
        "--export",
        "export",
        default="ALL",
        show_default=True,
        metavar="ALL|NONE|NAME,...",
        help="Environment the ranks get from this shell: all of it, none, or the named variables "
        "(--env pairs and HOME/USER/LOGNAME/SHELL of the submitter are added either way).",
    ),
    click.option(
        "--option", "options", multiple=True, metavar="K=V", help="Task option; numbers and true/false are typed."
    ),
    click.option(
        "--after",
        "after",
        multiple=True,
        metavar="JOB[,JOB...]",
        help="Start only once these jobs (ids or unique prefixes) have succeeded; fail if one does not.",
    ),
    click.option("--after-any", "after_any", multiple=True, metavar="JOB[,JOB...]",
                 help="Start only once these jobs have ended, however they ended (Slurm's afterany)."),
    click.option("--after-notok", "after_notok", multiple=True, metavar="JOB[,JOB...]",
                 help="Start only once these jobs have ended otherwise than SUCCEEDED (afternotok); fail if one "
                 "succeeds."),
    click.option(
        "-m",
        "--module",
        "module",
        is_flag=True,
        help="Run a module (python -m): `-m pkg.mod -- ARGS` or `-- -m pkg.mod ARGS`.",
    ),
]


def spec_options(func: F) -> F:
    """The submit command's job options, in the order `--help` lists them."""
    for option in reversed(_OPTIONS):
        func = option(func)
    return func


def spec_from_options(values: dict[str, Any], script: tuple[str, ...]) -> JobSpec:
    """The JobSpec of the submit options in `values` (named as click names them) and the script."""
    fields: dict[str, Any] = {key: values[key] for key in _PLAIN if values.get(key) is not None}
    # the submitter's directory by default, so `--task mymodule:factory` and relative paths
    # mean what they mean in the shell that ran ddpctl
    workdir = values.get("workdir")
    fields["workdir"] = os.path.abspath(workdir if workdir is not None else os.getcwd())
    timeouts = {key: values[name] for name, key in _TIMEOUTS.items() if values.get(name) is not None}
    if timeouts:
        fields["timeouts"] = timeouts
    if values.get("mem") is not None:
        fields["memory"] = parse_bytes(str(values["mem"]))
    if values.get("env"):
        fields["env"] = dict(pairs("--env", values["env"]))
    python = values.get("python")
    fields["python"] = os.path.abspath(python if python is not None else sys.executable)
    fields["export"], fields["environ"] = exported(str(values.get("export") or "ALL"), os.environ)
    fields["umask"] = current_umask()
    if values.get("options"):
        fields["options"] = {key: typed_value(value) for key, value in pairs("--option", values["options"])}
    for key in ("after", "after_any", "after_notok"):
        ids = [job.strip() for item in values.get(key) or () for job in item.split(",") if job.strip()]
        if ids:
            fields[key] = ids
    module = bool(values.get("module"))
    if script and script[0] == "-m":  # `submit -- -m pkg.mod ARGS`, as after python or torchrun
        module, script = True, script[1:]
    if module and len(script) > 1 and script[1] == "--":  # `submit -m pkg.mod -- ARGS`
        script = (script[0], *script[2:])
    if script:
        target, *args = script
        if not module and os.path.isfile(target):
            target = os.path.abspath(target)
        fields["script"] = [target, *args]
        fields["module"] = module
    elif module:
        raise click.UsageError("-m needs a module name after `--`")
    return build_spec(fields)


def exported(export: str, environ: Mapping[str, str]) -> tuple[str, dict[str, str]]:
    """`--export`'s spelling as sent, and the variables it selects from `environ`."""
    text = export.strip()
    if text.upper() == "ALL":
        chosen, text = dict(environ), "ALL"
    elif text.upper() == "NONE":
        chosen, text = {}, "NONE"
    else:
        names = [name.strip() for name in text.split(",") if name.strip()]
        if not names:
            raise click.BadParameter("give ALL, NONE or a comma-separated list of names", param_hint="--export")
        chosen = {name: environ[name] for name in names if name in environ}
        text = ",".join(names)
    size = len(msgspec.json.encode(chosen))
    if size > ENVIRON_BUDGET:
        raise click.BadParameter(
            f"the environment to export is {size} bytes, more than a submit may carry ({ENVIRON_BUDGET}); "
            "name the variables the job needs (--export NAME,...)", param_hint="--export")
    return text, chosen
