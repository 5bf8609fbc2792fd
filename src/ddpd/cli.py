"""ddpctl: the command line of ddpd, a thin layer over `ddpd.client`.

Data (job ids, tables, JSON, logs) goes to stdout; human status lines and errors go to stderr.
Exit codes: 0 success, 1 failure (an error reply, a job that did not succeed), 2 usage or a
bad job spec, 3 the daemon cannot be reached, 130 interrupted.
"""

from __future__ import annotations

import datetime
import os
import pwd
import queue
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import click
import msgspec
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from ddpd.client import (
    BUILTIN_TASKS,
    Client,
    DaemonInfo,
    DaemonUnavailable,
    ErrorCode,
    EventView,
    JobState,
    JobView,
    LogChunk,
    RemoteError,
    RootCause,
    SpecError,
    build_spec,
)

F = TypeVar("F", bound=Callable[..., Any])

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_UNAVAILABLE = 3
EXIT_INTERRUPTED = 130

_USAGE_CODES = frozenset({ErrorCode.BAD_SPEC.value})
_FINAL = frozenset(s.value for s in JobState if s.final)

_STATE_STYLES = {
    "QUEUED": "dim",
    "STARTING": "cyan",
    "RUNNING": "bold cyan",
    "RESTARTING": "yellow",
    "SUCCEEDED": "bold green",
    "FAILED": "bold red",
    "CANCELLED": "yellow",
    "TIMED_OUT": "bold red",
    "SPAWNED": "dim",
    "CONNECTED": "cyan",
    "STORE_CONNECTED": "cyan",
    "JOINED": "cyan",
    "TRAINING": "bold cyan",
    "EXITED": "",
}


# Consoles: rich for tables and styled lines, never interpreting markup in data


def _stdout() -> Console:
    width = None if sys.stdout.isatty() or "COLUMNS" in os.environ else 200
    return Console(markup=False, highlight=False, emoji=False, width=width)


def _stderr() -> Console:
    return Console(stderr=True, markup=False, highlight=False, emoji=False)


def _note(message: str, style: str = "") -> None:
    _stderr().print(Text(message, style=style), soft_wrap=True)


def _error(message: str) -> None:
    _stderr().print(Text(f"ddpctl: error: {message}", style="red"), soft_wrap=True)


def _print_json(value: Any) -> None:
    sys.stdout.write(msgspec.json.encode(value).decode() + "\n")
    sys.stdout.flush()


# Formatting


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return ""
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def _exit_text(exit_code: int | None, signal: str | None) -> str:
    if signal:
        return signal
    if exit_code is not None:
        return f"exit {exit_code}"
    return ""


def _state(state: str) -> Text:
    return Text(state, style=_STATE_STYLES.get(state, ""))


def _owner(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _cause_short(view: JobView) -> str:
    cause = view.root_cause
    if cause is None:
        return view.reason or ""
    parts = [cause.reason]
    if cause.rank is not None:
        parts.append(f"rank {cause.rank}")
    exit_text = _exit_text(cause.exit_code, cause.signal)
    if exit_text:
        parts.append(exit_text)
    if cause.error:
        parts.append(cause.error)
    return ": ".join(parts)


def _cause_lines(cause: RootCause, traceback_lines: int = 12) -> list[tuple[str, str]]:
    rows = [("root cause", cause.reason)]
    if cause.rank is not None:
        rows.append(("rank", str(cause.rank)))
    if cause.attempt is not None:
        rows.append(("attempt", str(cause.attempt)))
    exit_text = _exit_text(cause.exit_code, cause.signal)
    if exit_text:
        rows.append(("exit", exit_text))
    if cause.phase:
        rows.append(("phase", cause.phase))
    if cause.error or cause.message:
        rows.append(("error", ": ".join(p for p in (cause.error, cause.message) if p)))
    if cause.ranks:
        rows.append(("ranks", ", ".join(map(str, cause.ranks))))
    if cause.detail:
        rows.append(("detail", cause.detail))
    if cause.traceback:
        tail = cause.traceback.rstrip("\n").splitlines()[-traceback_lines:]
        rows.append(("traceback", "\n".join(tail)))
    return rows


def _final_line(view: JobView) -> str:
    line = f"job {view.id}"
    if view.name:
        line += f" ({view.name})"
    line += f" {view.state}"
    cause = _cause_short(view)
    if cause and view.state != JobState.SUCCEEDED:
        line += f": {cause}"
    if view.root_cause is not None and view.root_cause.message:
        line += f": {view.root_cause.message}"
    return line


def _job_header(view: JobView, now: float) -> Table:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column(overflow="fold")
    grid.add_row("job", Text(view.id))
    if view.name:
        grid.add_row("name", Text(view.name))
    grid.add_row("state", _state(view.state))
    grid.add_row("owner", Text(_owner(view.owner_uid)))
    grid.add_row("nproc", Text(str(view.spec.nproc)))
    grid.add_row("attempt", Text(str(view.attempt)))
    if view.started_at is not None:
        end = view.finished_at if view.finished_at is not None else now
        grid.add_row("duration", Text(_duration(end - view.started_at)))
    else:
        grid.add_row("queued for", Text(_duration(now - view.submitted_at)))
    if view.reason:
        grid.add_row("reason", Text(view.reason))
    if view.root_cause is not None:
        for key, value in _cause_lines(view.root_cause):
            grid.add_row(key, Text(value))
    return grid


def _ranks_table(view: JobView, title: str | None = None) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("rank", justify="right")
    table.add_column("attempt", justify="right")
    table.add_column("state")
    table.add_column("pid", justify="right")
    table.add_column("pgid", justify="right")
    table.add_column("step", justify="right")
    table.add_column("loss", justify="right")
    table.add_column("heartbeat", justify="right")
    table.add_column("exit")
    for rank in view.ranks:
        table.add_row(
            Text(str(rank.rank)),
            Text(str(rank.attempt)),
            _state(rank.state),
            Text("" if rank.pid is None else str(rank.pid)),
            Text("" if rank.pgid is None else str(rank.pgid)),
            Text(str(rank.step)),
            Text("" if rank.loss is None else f"{rank.loss:.4g}"),
            Text("" if rank.heartbeat_age is None else f"{rank.heartbeat_age:.1f}s ago"),
            Text(_exit_text(rank.exit_code, rank.signal)),
        )
    return table


def _job_detail(view: JobView, now: float) -> RenderableType:
    parts: list[RenderableType] = [_job_header(view, now)]
    if view.ranks:
        parts.append(_ranks_table(view))
    return Group(*parts)


def _jobs_table(views: Iterable[JobView], now: float) -> Table:
    table = Table()
    table.add_column("id", no_wrap=True)
    table.add_column("name", overflow="fold")
    table.add_column("owner")
    table.add_column("state")
    table.add_column("nproc", justify="right")
    table.add_column("attempt", justify="right")
    table.add_column("age", justify="right")
    table.add_column("duration", justify="right")
    table.add_column("root cause", overflow="fold")
    for view in views:
        duration = ""
        if view.started_at is not None:
            end = view.finished_at if view.finished_at is not None else now
            duration = _duration(end - view.started_at)
        table.add_row(
            Text(view.id),
            Text(view.name),
            Text(_owner(view.owner_uid)),
            _state(view.state),
            Text(str(view.spec.nproc)),
            Text(str(view.attempt)),
            Text(_duration(now - view.submitted_at)),
            Text(duration),
            Text(_cause_short(view) if view.state in _FINAL else ""),
        )
    return table


def _event_line(event: EventView) -> str:
    when = datetime.datetime.fromtimestamp(event.ts).isoformat(sep=" ", timespec="milliseconds")
    parts = [when, f"#{event.seq}", event.kind]
    if event.job_id is not None:
        parts.append(f"job={event.job_id}")
    if event.attempt is not None:
        parts.append(f"attempt={event.attempt}")
    if event.rank is not None:
        parts.append(f"rank={event.rank}")
    for key, value in event.data.items():
        text = value if isinstance(value, str) else msgspec.json.encode(value).decode()
        parts.append(f"{key}={text}")
    return " ".join(parts)


class _LogWriter:
    """Writes log chunks to stdout as they come, each line prefixed with its rank when asked."""

    def __init__(self, prefix: bool) -> None:
        self._prefix = prefix
        self._partial: dict[tuple[int, int], str] = {}

    def write(self, chunk: LogChunk) -> None:
        if not self._prefix:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            return
        key = (chunk.attempt, chunk.rank)
        lines = (self._partial.pop(key, "") + chunk.text).split("\n")
        if lines[-1]:
            self._partial[key] = lines[-1]
        sys.stdout.write("".join(f"[rank {chunk.rank}] {line}\n" for line in lines[:-1]))
        sys.stdout.flush()

    def finish(self) -> None:
        for (_, rank), rest in sorted(self._partial.items()):
            sys.stdout.write(f"[rank {rank}] {rest}\n")
        self._partial.clear()
        sys.stdout.flush()


# Command plumbing


class _Group(click.Group):
    """Turns expected errors into one line on stderr and an exit code, never a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except DaemonUnavailable as exc:
            _error(exc.message)
            ctx.exit(EXIT_UNAVAILABLE)
        except RemoteError as exc:
            _error(f"{exc.code}: {exc.message}")
            ctx.exit(EXIT_USAGE if exc.code in _USAGE_CODES else EXIT_FAILED)
        except SpecError as exc:
            _error(f"{ErrorCode.BAD_SPEC}: {exc}")
            ctx.exit(EXIT_USAGE)
        except KeyboardInterrupt:
            ctx.exit(EXIT_INTERRUPTED)


# not checked for readability here: a socket the user may not open is reported by the client
# (exit 3, "permission denied (are you in the socket's group?)"), not as a usage error
_SOCKET_PATH = click.Path(path_type=Path, readable=False)
_SOCKET_HELP = "Control socket of the daemon (default: $DDPD_SOCKET, else the user's, else the system's)."


def _socket_option(func: F) -> F:
    return click.option("--socket", "socket_path", type=_SOCKET_PATH, default=None, help=_SOCKET_HELP)(
        func
    )


def _output_option(func: F) -> F:
    return click.option(
        "-o",
        "--output",
        type=click.Choice(["table", "json"]),
        default="table",
        show_default=True,
        help="Output format (json: pure JSON on stdout).",
    )(func)


def _text_output_option(help: str) -> Callable[[F], F]:
    return click.option(
        "-o", "--output", type=click.Choice(["text", "json"]), default="text", show_default=True, help=help
    )


def _socket(socket_path: Path | None) -> Path | None:
    if socket_path is not None:
        return socket_path
    root = click.get_current_context().find_root()
    value = root.params.get("socket_path")
    return value if isinstance(value, Path) else None


def _client(socket_path: Path | None) -> Client:
    return Client(_socket(socket_path))


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--socket",
    "socket_path",
    type=_SOCKET_PATH,
    envvar="DDPD_SOCKET",
    show_envvar=True,
    default=None,
    help="Control socket of the daemon (also accepted after the command name).",
)
@click.version_option(package_name="ddpd", prog_name="ddpctl")
def cli(socket_path: Path | None) -> None:
    """Submit, watch and control PyTorch DDP jobs run by the ddpd daemon."""


# submit

_NUMBER = re.compile(r"^[+-]?(\d+\.\d*|\.\d+|\d+)([eE][+-]?\d+)?$")


def _typed_value(text: str) -> str | int | float | bool:
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    if re.fullmatch(r"[+-]?\d+", text):
        return int(text)
    if _NUMBER.match(text):
        return float(text)
    return text


def _pairs(param: str, values: tuple[str, ...]) -> list[tuple[str, str]]:
    pairs = []
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"expected KEY=VALUE, got {item!r}", param_hint=param)
        pairs.append((key, value))
    return pairs


def _seconds_option(name: str, help: str) -> Callable[[F], F]:
    return click.option(name, type=float, default=None, metavar="S", help=help)


@cli.command(context_settings={"allow_interspersed_args": False})
@click.option(
    "--task",
    default=None,
    help=f"Built-in task ({', '.join(sorted(BUILTIN_TASKS))}) or package.module:factory "
    "[default: two-layer, unless a script is given].",
)
@click.option("--nproc", type=int, default=None, help="Number of ranks [default: 1].")
@click.option("--name", default=None, help="A name for the job.")
@click.option("--backend", type=click.Choice(["auto", "gloo", "nccl"]), default=None)
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default=None)
@click.option("--gpus-per-rank", type=int, default=None, metavar="N")
@click.option("--steps", type=int, default=None, metavar="N", help="Training steps of a built-in task.")
@click.option("--seed", type=int, default=None, metavar="N")
@_seconds_option("--join-timeout", "Seconds for every rank to join.")
@_seconds_option("--heartbeat-timeout", "Seconds without any frame from a rank before it counts as hung.")
@_seconds_option("--progress-timeout", "Seconds without a step before the job counts as hung.")
@_seconds_option("--wall-time", "Wall-clock limit of the job in seconds.")
@_seconds_option("--kill-grace", "Seconds between SIGTERM and SIGKILL.")
@_seconds_option("--stop-warning", "Seconds before the wall time at which ranks are asked to checkpoint and stop.")
@click.option("--max-restarts", type=int, default=None, metavar="N")
@click.option("--checkpoint-every", type=int, default=None, metavar="N", help="Checkpoint every N steps.")
@click.option("--priority", type=int, default=None, metavar="N")
@click.option("--env", "env", multiple=True, metavar="K=V", help="Environment variable for every rank.")
@click.option(
    "--workdir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    metavar="DIR",
    help="Working directory of every rank; relative scripts and task modules are found there "
    "[default: the current directory].",
)
@click.option(
    "--option",
    "options",
    multiple=True,
    metavar="K=V",
    help="Task option; numbers and true/false are typed.",
)
@click.option(
    "-m",
    "--module",
    "module",
    is_flag=True,
    help="Run a module (python -m): `-m pkg.mod -- ARGS` or `-- -m pkg.mod ARGS`.",
)
@click.option("-f", "--follow", is_flag=True, help="Stream the logs until the job ends; exit 0 only on success.")
@_socket_option
@click.argument("script", nargs=-1, type=click.UNPROCESSED, metavar="[-- SCRIPT ARGS...]")
def submit(
    task: str | None,
    nproc: int | None,
    name: str | None,
    backend: str | None,
    device: str | None,
    gpus_per_rank: int | None,
    steps: int | None,
    seed: int | None,
    join_timeout: float | None,
    heartbeat_timeout: float | None,
    progress_timeout: float | None,
    wall_time: float | None,
    kill_grace: float | None,
    stop_warning: float | None,
    max_restarts: int | None,
    checkpoint_every: int | None,
    priority: int | None,
    env: tuple[str, ...],
    workdir: Path | None,
    options: tuple[str, ...],
    module: bool,
    follow: bool,
    socket_path: Path | None,
    script: tuple[str, ...],
) -> None:
    """Submit a job and print its id.

    Without a script, every rank runs a task's training loop. After `--`, every rank runs an
    unmodified torchrun script (or, with -m, a module) with its arguments.
    """
    fields: dict[str, Any] = {
        "name": name,
        "task": task,
        "nproc": nproc,
        "backend": backend,
        "device": device,
        "gpus_per_rank": gpus_per_rank,
        "steps": steps,
        "seed": seed,
        "max_restarts": max_restarts,
        "checkpoint_every": checkpoint_every,
        "priority": priority,
        # the submitter's directory by default, so `--task mymodule:factory` and relative paths
        # mean what they mean in the shell that ran ddpctl
        "workdir": os.path.abspath(workdir if workdir is not None else os.getcwd()),
    }
    fields = {key: value for key, value in fields.items() if value is not None}
    timeouts = {
        "join": join_timeout,
        "heartbeat": heartbeat_timeout,
        "progress": progress_timeout,
        "wall": wall_time,
        "kill_grace": kill_grace,
        "stop_warning": stop_warning,
    }
    timeouts = {key: value for key, value in timeouts.items() if value is not None}
    if timeouts:
        fields["timeouts"] = timeouts
    if env:
        fields["env"] = dict(_pairs("--env", env))
    if options:
        fields["options"] = {key: _typed_value(value) for key, value in _pairs("--option", options)}
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

    spec = build_spec(fields)
    client = _client(socket_path)
    job_id = client.submit(spec)
    click.echo(job_id)
    if follow:
        sys.stdout.flush()
        view = _follow_to_end(client, job_id)
        sys.exit(0 if view.state == JobState.SUCCEEDED else EXIT_FAILED)


def _follow_to_end(client: Client, job_id: str) -> JobView:
    writer = _LogWriter(prefix=True)
    try:
        with client.logs(job_id, follow=True) as chunks:
            for chunk in chunks:
                writer.write(chunk)
    finally:
        writer.finish()
    view = client.wait(job_id)
    _report_final(view)
    return view


def _report_final(view: JobView) -> None:
    ok = view.state == JobState.SUCCEEDED
    _note(_final_line(view), "green" if ok else "red")
    if not ok and view.root_cause is not None and view.root_cause.traceback:
        _note(view.root_cause.traceback.rstrip("\n"))


# Queries and control


@cli.command()
@click.argument("job_id", metavar="JOB")
@_output_option
@_socket_option
def wait(job_id: str, output: str, socket_path: Path | None) -> None:
    """Block until JOB ends; exit 0 only if it succeeded."""
    view = _client(socket_path).wait(job_id)
    if output == "json":
        _print_json(view)
    _note(_final_line(view), "green" if view.state == JobState.SUCCEEDED else "red")
    sys.exit(0 if view.state == JobState.SUCCEEDED else EXIT_FAILED)


@cli.command()
@click.argument("job_id", metavar="JOB")
@_output_option
@_socket_option
def status(job_id: str, output: str, socket_path: Path | None) -> None:
    """Show JOB: its state, root cause and ranks."""
    view = _client(socket_path).status(job_id)
    if output == "json":
        _print_json(view)
        return
    _stdout().print(_job_detail(view, time.time()))


@cli.command("ls")
@click.option("--active", is_flag=True, help="Only jobs that have not ended.")
@click.option("--limit", type=int, default=200, show_default=True)
@_output_option
@_socket_option
def list_jobs(active: bool, limit: int, output: str, socket_path: Path | None) -> None:
    """List jobs."""
    views = _client(socket_path).list_jobs(all=not active, limit=limit)
    if output == "json":
        _print_json(views)
        return
    _stdout().print(_jobs_table(views, time.time()))


@cli.command()
@click.argument("job_id", metavar="JOB")
@click.option("--force", is_flag=True, help="Kill at once (SIGKILL) instead of a graceful stop.")
@_output_option
@_socket_option
def cancel(job_id: str, force: bool, output: str, socket_path: Path | None) -> None:
    """Cancel JOB."""
    view = _client(socket_path).cancel(job_id, force=force)
    if output == "json":
        _print_json(view)
    _note(f"job {view.id}: {view.state}")


@cli.command()
@click.argument("job_id", metavar="JOB")
@click.option("--rank", type=int, default=None, help="Only this rank [default: all, each line prefixed].")
@click.option("--attempt", type=int, default=None, help="This attempt [default: the daemon's choice].")
@click.option("-f", "--follow", is_flag=True, help="Keep following until the job ends.")
@click.option("--no-prefix", is_flag=True, help="Do not prefix lines with their rank.")
@_text_output_option("text: the logs as written; json: one object per chunk ({rank, attempt, text}).")
@_socket_option
def logs(
    job_id: str,
    rank: int | None,
    attempt: int | None,
    follow: bool,
    no_prefix: bool,
    output: str,
    socket_path: Path | None,
) -> None:
    """Print the logs of JOB as they are (stdout and stderr of its ranks)."""
    with _client(socket_path).logs(job_id, rank=rank, attempt=attempt, follow=follow) as chunks:
        if output == "json":
            for chunk in chunks:
                _print_json(chunk)
            return
        writer = _LogWriter(prefix=rank is None and not no_prefix)
        try:
            for chunk in chunks:
                writer.write(chunk)
        finally:
            writer.finish()


@cli.command()
@click.argument("job_id", metavar="[JOB]", required=False)
@click.option("-f", "--follow", is_flag=True, help="Keep following new events.")
@click.option("--since", type=int, default=0, metavar="SEQ", help="Only events after this sequence number.")
@_text_output_option("text: one line per event; json: one JSON object per line.")
@_socket_option
def events(job_id: str | None, follow: bool, since: int, output: str, socket_path: Path | None) -> None:
    """Print the events of JOB (or of every job)."""
    with _client(socket_path).events(job_id, follow=follow, since=since) as stream:
        for event in stream:
            if output == "json":
                _print_json(event)
            else:
                sys.stdout.write(_event_line(event) + "\n")
                sys.stdout.flush()


@cli.command()
@_socket_option
def ping(socket_path: Path | None) -> None:
    """Check that the daemon answers; print the round trip."""
    client = _client(socket_path)
    seconds = client.ping()
    click.echo(f"pong from {client.socket_path}: {seconds * 1000:.3f} ms")


@cli.command("daemon")
@_output_option
@_socket_option
def daemon_info(output: str, socket_path: Path | None) -> None:
    """Show the daemon: version, pid, uptime, socket, state dir, load and resources."""
    info = _client(socket_path).daemon_info()
    if output == "json":
        _print_json(info)
        return
    _stdout().print(_daemon_grid(info))


def _daemon_grid(info: DaemonInfo) -> Table:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column(overflow="fold")
    rows = [
        ("version", f"{info.version} (protocol {info.protocol})"),
        ("pid", str(info.pid)),
        ("uptime", _duration(info.uptime)),
        ("socket", info.socket),
        ("state dir", info.state_dir),
        ("running", str(info.running)),
        ("queued", str(info.queued)),
        ("cpu slots", _free_of(info.free_cpu_slots, info.cpu_slots)),
        ("gpus", _free_of(info.free_gpus, info.gpus)),
    ]
    if info.pool_ready is not None:
        rows.append(("warm pool", f"{info.pool_ready} ready"))
    for key, value in rows:
        grid.add_row(key, Text(value))
    return grid


def _free_of(free: int | None, total: int) -> str:
    return str(total) if free is None else f"{free} free of {total}"


@cli.command()
@_socket_option
def reload(socket_path: Path | None) -> None:
    """Ask the daemon to reload its configuration."""
    _client(socket_path).reload()
    _note("reloaded")


# watch


@cli.command()
@click.argument("job_id", metavar="[JOB]", required=False)
@_text_output_option("text: a live view; json: one JSON snapshot per refresh (the job, or the list of jobs).")
@_socket_option
def watch(job_id: str | None, output: str, socket_path: Path | None) -> None:
    """A live view of JOB (or of all jobs): state, ranks, step, loss, heartbeat age.

    It refreshes on every event of the daemon's event stream, and once a second for the
    heartbeat ages. It runs until Ctrl-C (exit 0) or, with JOB, until JOB ends (exit 0 if it
    succeeded, else 1).
    """
    client = _client(socket_path)
    if output == "json":
        try:
            view = _watch(client, job_id, lambda views: _print_json(views[0] if job_id is not None else views))
        except KeyboardInterrupt:
            return
        if view is not None:
            sys.exit(0 if view.state == JobState.SUCCEEDED else EXIT_FAILED)
        return
    console = _stdout()
    shown = False
    live = Live(Text(""), console=console, refresh_per_second=4)

    def show(views: list[JobView]) -> None:
        nonlocal shown
        shown = True
        live.update(_watch_view(views, job_id is not None), refresh=True)

    try:
        with live:
            view = _watch(client, job_id, show)
    except KeyboardInterrupt:
        return
    finally:
        if shown and not console.is_terminal:
            console.line()  # Live ends its last frame with a newline only on a terminal
    if view is not None:
        _report_final(view)
        sys.exit(0 if view.state == JobState.SUCCEEDED else EXIT_FAILED)


def _watch_view(views: list[JobView], single: bool) -> RenderableType:
    now = time.time()
    if single:
        return _job_detail(views[0], now)
    parts: list[RenderableType] = [_jobs_table(views, now)]
    for active in [v for v in views if v.state not in _FINAL and v.ranks][:8]:
        parts.append(_ranks_table(active, title=f"{active.id} {active.name}".rstrip()))
    return Group(*parts)


def _watch(client: Client, job_id: str | None, show: Callable[[list[JobView]], None]) -> JobView | None:
    """Refresh on every event and once a second; returns the watched job once it is final.

    The event stream is read by a daemon thread that only wakes this one (blocking sockets:
    closing the stream's connection ends its read).
    """
    wakeups: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()
    stream = client.events(job_id, follow=True)

    def pump() -> None:
        try:
            for _ in stream:
                wakeups.put(None)
            wakeups.put(_StreamEnded())
        except BaseException as exc:
            wakeups.put(exc)

    def refresh() -> JobView | None:
        if job_id is not None:
            view = client.status(job_id)
            show([view])
            return view if view.state in _FINAL else None
        show(client.list_jobs())
        return None

    final = refresh()  # a bad JOB fails here, before the stream starts
    if final is not None:
        return final
    threading.Thread(target=pump, name="ddpctl-events", daemon=True).start()
    try:
        while True:
            failure: BaseException | None = None
            try:
                failure = wakeups.get(timeout=1.0)
                while not wakeups.empty():  # one refresh for a burst of events
                    failure = failure or wakeups.get_nowait()
            except queue.Empty:
                pass
            final = refresh()
            if final is not None:
                return final
            if isinstance(failure, _StreamEnded):
                if job_id is None:
                    raise RemoteError("stream_ended", "the daemon ended the event stream")
                failure = None  # the job's stream ends at job.finished: the next refresh sees it final
            if failure is not None:
                raise failure
    finally:
        stream.close()


class _StreamEnded(Exception):
    pass


def main() -> None:
    cli.main(prog_name="ddpctl")


if __name__ == "__main__":
    main()
