"""Shell completion: `ddpctl completion bash|zsh|fish` prints click's script, and job ids complete
from the daemon.

Every `JOB` argument of every command (and `--after`) gets the `JobIdType`, whose completions are
the ids of the daemon's newest jobs (one page, at most COMPLETION_JOBS) that start with what was
typed, each with its state and name. The daemon gets COMPLETION_TIMEOUT seconds to answer; when it
is down or slow the completion is empty and nothing is printed, so a shell never hangs or shows an
error while its user presses Tab.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import click
from click.shell_completion import CompletionItem, get_completion_class

from ddpd.client import AsyncClient

SHELLS = ("bash", "zsh", "fish")
COMPLETE_VAR = "_DDPCTL_COMPLETE"
COMPLETION_JOBS = 200
COMPLETION_TIMEOUT = 1.0


def completion_script(group: click.Group, shell: str, prog_name: str = "ddpctl") -> str:
    """The script that makes `shell` complete `prog_name` (click's, for this command group)."""
    cls = get_completion_class(shell)
    if cls is None:
        raise click.BadParameter(f"unsupported shell {shell!r}", param_hint="SHELL")
    return cls(group, {}, prog_name, COMPLETE_VAR).source()


def _socket(ctx: click.Context) -> Path | None:
    """The socket the command line names (after the command, or before it), else None (the default)."""
    node: click.Context | None = ctx
    while node is not None:
        value = node.params.get("socket_path")
        if isinstance(value, Path | str):
            return Path(value)
        node = node.parent
    return None


async def _job_ids(socket: Path | None) -> list[tuple[str, str]]:
    page = await AsyncClient(socket).list_page(limit=COMPLETION_JOBS)
    return [(job.id, f"{job.state} {job.name}".strip()) for job in page.jobs]


def job_completions(socket: Path | None, incomplete: str) -> list[CompletionItem]:
    """Ids of the daemon's newest jobs that start with `incomplete`; [] when it does not answer in time."""

    async def bounded() -> list[tuple[str, str]]:
        with anyio.move_on_after(COMPLETION_TIMEOUT):
            return await _job_ids(socket)
        return []

    try:
        jobs = anyio.run(bounded)
    except Exception:  # daemon down, unsafe socket, an older daemon: complete nothing, say nothing
        return []
    return [CompletionItem(job_id, help=about) for job_id, about in jobs if job_id.startswith(incomplete)]


class JobIdType(click.ParamType[str]):
    """A job id or a unique prefix of one (the daemon resolves it); completes from the daemon."""

    name = "job"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        return value

    def shell_complete(self, ctx: click.Context, param: click.Parameter, incomplete: str) -> list[CompletionItem]:
        # the last id of a comma-separated list (--after a,b) is the one being typed
        head, sep, tail = incomplete.rpartition(",")
        items = job_completions(_socket(ctx), tail)
        return [CompletionItem(head + sep + item.value, help=item.help) for item in items]


JOB_ID = JobIdType()
_JOB_PARAMS = ("job_id", "job_ids", "after", "after_any", "after_notok")


def complete_job_ids(group: click.Group) -> None:
    """Give every `job_id` argument and `--after` option of the group's commands the JobIdType."""
    for command in group.commands.values():
        for param in command.params:
            if param.name in _JOB_PARAMS and isinstance(param.type, click.types.StringParamType):
                param.type = JOB_ID
