"""ddpctl's commands, a thin layer over `ddpd.client`.

Data (job ids, tables, JSON, logs) goes to stdout; human status lines and errors go to stderr.
Exit codes: 0 success, 1 failure (an error reply, a job that did not succeed), 2 usage or a
bad job spec, 3 the daemon cannot be reached, 130 interrupted.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from ddpd.client import (
    MAX_TAIL,
    AsyncClient,
    Client,
    DaemonUnavailable,
    ErrorCode,
    JobState,
    JobView,
    LogStream,
    QueryError,
    RemoteError,
    SpecError,
    parse_rank_set,
    parse_since,
)

from . import curves, render
from .completion import SHELLS, complete_job_ids, completion_script
from .jobfile import job_defaults, read_job_file
from .output import LogWriter, error, note, print_json, stdout
from .specs import spec_from_options, spec_options
from .stacks import show_stacks
from .watch import run_watch

F = TypeVar("F", bound=Callable[..., Any])

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_UNAVAILABLE = 3
EXIT_INTERRUPTED = 130

_USAGE_CODES = frozenset({ErrorCode.BAD_SPEC.value})


class _Group(click.Group):
    """Turns expected errors into one line on stderr and an exit code, never a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except DaemonUnavailable as exc:
            error(exc.message)
            ctx.exit(EXIT_UNAVAILABLE)
        except RemoteError as exc:
            error(f"{exc.code}: {exc.message}")
            ctx.exit(EXIT_USAGE if exc.code in _USAGE_CODES else EXIT_FAILED)
        except SpecError as exc:
            error(f"{ErrorCode.BAD_SPEC}: {exc}")
            ctx.exit(EXIT_USAGE)
        except KeyboardInterrupt:
            ctx.exit(EXIT_INTERRUPTED)


# not checked for readability here: a socket the user may not open is reported by the client
# (exit 3, "permission denied (are you in the socket's group?)"), not as a usage error
_SOCKET_PATH = click.Path(path_type=Path, readable=False)
_SOCKET_HELP = "Control socket of the daemon (default: $DDPD_SOCKET, else the user's, else the system's)."


def _socket_option(func: F) -> F:
    return click.option("--socket", "socket_path", type=_SOCKET_PATH, default=None, help=_SOCKET_HELP)(func)


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


def _exit_for(view: JobView) -> None:
    sys.exit(0 if view.state == JobState.SUCCEEDED else EXIT_FAILED)


def _report_final(view: JobView) -> None:
    ok = view.state == JobState.SUCCEEDED
    note(render.final_line(view), "green" if ok else "red")
    if not ok and view.root_cause is not None and view.root_cause.traceback:
        note(view.root_cause.traceback.rstrip("\n"))


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


_JOB_SCRIPT = "ddpd.job_file_script"


def _load_job_file(ctx: click.Context, param: click.Parameter, value: Path | None) -> Path | None:
    """Eager: the job file's keys become the defaults of the other options (flags win over them)."""
    if value is not None:
        defaults, script = job_defaults(ctx.command, value, read_job_file(value))
        ctx.default_map = {**(ctx.default_map or {}), **defaults}
        ctx.meta[_JOB_SCRIPT] = tuple(script)
    return value


@cli.command(context_settings={"allow_interspersed_args": False})
@click.option("-f", "--file", "job_file", type=click.Path(path_type=Path, dir_okay=True), is_eager=True,
              expose_value=False, callback=_load_job_file, metavar="JOB.toml",
              help="A job file: TOML whose keys are these options (flags given here win) and `script`.")
@spec_options
@click.option("--idempotency-key", default=None, metavar="KEY",
              help="Submit at most once under KEY: a retry with the same KEY prints the job it created.")
@click.option("--follow", is_flag=True, help="Stream the logs until the job ends; exit 0 only on success.")
@_socket_option
@click.argument("script", nargs=-1, type=click.UNPROCESSED, metavar="[-- SCRIPT ARGS...]")
def submit(idempotency_key: str | None, follow: bool, socket_path: Path | None, script: tuple[str, ...],
           **options: Any) -> None:
    """Submit a job and print its id.

    Without a script, every rank runs a task's training loop. After `--`, every rank runs an
    unmodified torchrun script (or, with -m, a module) with its arguments. With -f, the job
    file gives the options and the script; what the command line gives wins.
    """
    script = script or click.get_current_context().meta.get(_JOB_SCRIPT, ())
    spec = spec_from_options(options, script)
    client = _client(socket_path)
    result = client.submit_result(spec, idempotency_key=idempotency_key)
    click.echo(result.job_id)
    if result.existing:
        note(f"job {result.job_id} was already submitted with this idempotency key")
    if follow:
        sys.stdout.flush()
        _exit_for(_follow_to_end(client, result.job_id))


def _follow_to_end(client: Client, job_id: str) -> JobView:
    writer = LogWriter(prefix=True)
    try:
        with client.logs(job_id, follow=True) as chunks:
            for chunk in chunks:
                writer.write(chunk)
    finally:
        writer.finish()
    view = client.wait(job_id)
    _report_final(view)
    return view


@cli.command()
@click.argument("job_id", metavar="JOB")
@click.option("--idempotency-key", default=None, metavar="KEY",
              help="Submit at most once under KEY: a retry with the same KEY prints the job it created.")
@_socket_option
def resubmit(job_id: str, idempotency_key: str | None, socket_path: Path | None) -> None:
    """Submit JOB's spec again (its environment and interpreter as then) and print the new job's id."""
    result = _client(socket_path).resubmit(job_id, idempotency_key=idempotency_key)
    click.echo(result.job_id)
    if result.existing:
        note(f"job {result.job_id} was already submitted with this idempotency key")


@cli.command()
@click.argument("shell", type=click.Choice(SHELLS))
def completion(shell: str) -> None:
    """Print the shell completion script for SHELL (job ids complete from the daemon).

    bash: eval "$(ddpctl completion bash)" in ~/.bashrc; zsh: the same in ~/.zshrc;
    fish: ddpctl completion fish > ~/.config/fish/completions/ddpctl.fish
    """
    click.echo(completion_script(cli, shell))


@cli.command()
@click.argument("job_id", metavar="JOB")
@click.option("--exit-code", "rank_exit_code", is_flag=True,
              help="Exit with the exit code of the rank that failed first (1 when there is none).")
@_output_option
@_socket_option
def wait(job_id: str, rank_exit_code: bool, output: str, socket_path: Path | None) -> None:
    """Block until JOB ends; exit 0 only if it succeeded."""
    view = _client(socket_path).wait(job_id)
    if output == "json":
        print_json(view)
    note(render.final_line(view), "green" if view.state == JobState.SUCCEEDED else "red")
    cause = view.root_cause
    if rank_exit_code and view.state != JobState.SUCCEEDED and cause is not None and cause.exit_code:
        sys.exit(cause.exit_code)
    _exit_for(view)


@cli.command()
@click.argument("job_id", metavar="JOB")
@_output_option
@_socket_option
def status(job_id: str, output: str, socket_path: Path | None) -> None:
    """Show JOB: its state, root cause and ranks."""
    view = _client(socket_path).status(job_id)
    if output == "json":
        print_json(view)
        return
    stdout().print(render.job_detail(view, time.time()))


@cli.command("ls")
@click.option("--active", is_flag=True, help="Only jobs that have not ended.")
@click.option("--limit", type=int, default=200, show_default=True, help="Jobs per page, newest first.")
@click.option("--before", type=int, default=None, metavar="SEQ", help="The page after the one that said so.")
@_output_option
@_socket_option
def list_jobs(active: bool, limit: int, before: int | None, output: str, socket_path: Path | None) -> None:
    """List jobs, newest first, one page at a time (JSON: the page's jobs)."""
    page = _client(socket_path).list_page(all=not active, limit=limit, before=before)
    if output == "json":
        print_json(page.jobs)
    else:
        stdout().print(render.jobs_table(page.jobs, time.time()))
    if page.next is not None:
        note(f"more jobs: ddpctl ls --limit {limit} --before {page.next}{' --active' if active else ''}")


@cli.command()
@click.argument("job_id", metavar="JOB")
@click.option("--force", is_flag=True, help="Kill at once (SIGKILL) instead of a graceful stop.")
@_output_option
@_socket_option
def cancel(job_id: str, force: bool, output: str, socket_path: Path | None) -> None:
    """Cancel JOB: a queued job ends at once; a running one is stopped (or, with --force, killed)."""
    result = _client(socket_path).cancel(job_id, force=force)
    if output == "json":
        print_json(result)
    note(render.cancel_line(result))


@cli.command("rm")
@click.argument("job_id", metavar="JOB")
@_socket_option
def remove(job_id: str, socket_path: Path | None) -> None:
    """Forget an ended JOB: its record, events, logs and checkpoints."""
    _client(socket_path).remove(job_id)
    note(f"removed {job_id}")


@cli.command()
@click.argument("job_id", metavar="JOB")
@click.option("--rank", "rank_set", default=None, metavar="RANKS",
              help="Only these ranks: 0, 0,2-3 [default: all, each line prefixed unless one rank].")
@click.option("--attempt", type=int, default=None, help="This attempt [default: the daemon's choice].")
@click.option("-f", "--follow", is_flag=True, help="Keep following until the job ends.")
@click.option("--tail", type=click.IntRange(0, MAX_TAIL), default=None, metavar="N",
              help="Only the last N lines of each rank (then follow, with -f).")
@click.option("--since", default=None, metavar="WHEN",
              help="Only lines received since WHEN: 30s, 10m, 2h, 1d ago, or an ISO-8601 time.")
@click.option("--stream", type=click.Choice(["stdout", "stderr", "both"]), default="both", show_default=True,
              help="Which output of the ranks (kept apart on disk; both: merged by the time received).")
@click.option("-t", "--timestamps", is_flag=True, help="Prefix each line with the time the daemon received it (UTC).")
@click.option("--no-prefix", is_flag=True, help="Do not prefix lines with their rank.")
@_text_output_option("text: the logs as written; json: one object per chunk ({rank, attempt, text, stream, time}).")
@_socket_option
def logs(job_id: str, rank_set: str | None, attempt: int | None, follow: bool, tail: int | None, since: str | None,
         stream: LogStream, timestamps: bool, no_prefix: bool, output: str, socket_path: Path | None) -> None:
    """Print the logs of JOB (stdout and stderr of its ranks, by the time the daemon received them)."""
    try:
        ranks = parse_rank_set(rank_set) if rank_set is not None else None
    except QueryError as exc:
        raise click.BadParameter(str(exc), param_hint="--rank") from None
    try:
        start = parse_since(since, time.time()) if since is not None else None
    except QueryError as exc:
        raise click.BadParameter(str(exc), param_hint="--since") from None
    with _client(socket_path).logs(job_id, attempt=attempt, follow=follow, ranks=ranks, stream=stream, tail=tail,
                                   since=start) as chunks:
        if output == "json":
            for chunk in chunks:
                print_json(chunk)
            return
        one = ranks is not None and len(ranks) == 1
        writer = LogWriter(prefix=not one and not no_prefix, timestamps=timestamps)
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
                print_json(event)
            else:
                sys.stdout.write(render.event_line(event) + "\n")
                sys.stdout.flush()


@cli.command()
@click.argument("job_id", metavar="JOB")
@click.option("--rank", type=int, default=None, help="Only this rank [default: every rank].")
@click.option("--native", is_flag=True, help="Native frames too (py-spy, where the daemon has it).")
@_text_output_option("text: each distinct stack once, with its ranks; json: the daemon's result.")
@_socket_option
def stacks(job_id: str, rank: int | None, native: bool, output: str, socket_path: Path | None) -> None:
    """Show where every thread of JOB's ranks is now; the job keeps running."""
    show_stacks(_client(socket_path), job_id, rank, native, output == "json")


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
        print_json(info)
        return
    stdout().print(render.daemon_grid(info))


@cli.command()
@_socket_option
def reload(socket_path: Path | None) -> None:
    """Ask the daemon to reload its configuration."""
    _client(socket_path).reload()
    note("reloaded")


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
    view = run_watch(AsyncClient(_socket(socket_path)), job_id, as_json=output == "json")
    if view is not None:
        if output != "json":
            _report_final(view)
        _exit_for(view)


@cli.command()
@click.argument("job_id", metavar="JOB")
@click.option("--png", type=click.Path(path_type=Path, dir_okay=False), default=None, metavar="FILE",
              help="Write the plot to FILE as a PNG (needs matplotlib: the extra 'plot').")
@click.option("--size", default="800x480", show_default=True, metavar="WxH", help="Size of the PNG in pixels.")
@_socket_option
def plot(job_id: str, png: Path | None, size: str, socket_path: Path | None) -> None:
    """Draw JOB's loss curve against the step: in the terminal, or (--png) as a picture."""
    try:
        pixels = curves.parse_size(size)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--size") from None
    curve = _client(socket_path).curve(job_id)
    if not curves.losses(curve):
        error(f"job {job_id} has no loss recorded ({curve.state})")
        sys.exit(EXIT_FAILED)
    if png is None:
        sys.stdout.write(curves.terminal_plot(curve, color=sys.stdout.isatty()) + "\n")
        return
    try:
        curves.write_png(curve, png, pixels)
    except curves.PlotUnavailable as exc:
        error(str(exc))
        sys.exit(EXIT_FAILED)
    note(f"wrote {png}")


@cli.command("metrics")
@click.argument("job_id", metavar="JOB")
@click.option("-o", "--output", type=click.Choice(["csv", "json"]), default="csv", show_default=True,
              help="csv: a header and one row per point; json: the curve and its points as one object.")
@_socket_option
def metrics(job_id: str, output: str, socket_path: Path | None) -> None:
    """Export JOB's training curve: time, step, loss and steps per second, oldest first."""
    curve = _client(socket_path).curve(job_id)
    if output == "json":
        print_json({"job_id": curve.job_id, "state": curve.state, "steps": curve.steps, "stride": curve.stride,
                    "backwards": curve.backwards, "nonfinite": curve.nonfinite, "points": curves.to_rows(curve)})
    else:
        sys.stdout.write(curves.to_csv(curve))


complete_job_ids(cli)


def main() -> None:
    cli.main(prog_name="ddpctl")
