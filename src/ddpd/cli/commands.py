"""ddpctl's commands, a thin layer over `ddpd.client`: the job's life here (submit, resubmit, wait,
status, ls, cancel, rm); what one looks at in `observe` (logs, events, stacks, watch, plot,
curve); the daemon in `admin` (ping, daemon, reload, completion).

Data (job ids, tables, JSON, logs) goes to stdout; human status lines and errors go to stderr.
Exit codes: see `group`.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import click

from ddpd.client import Client, JobState, JobView, RemoteError

from . import render
from .completion import complete_job_ids
from .group import EXIT_FAILED, cli, client_for, exit_for, output_option, report_final, socket_option
from .jobfile import job_defaults, load_job_file
from .output import LogWriter, error, note, print_json, show
from .reconnect import follow_logs, reconnect_option, retrying
from .select import Selection
from .specs import spec_from_options, spec_options

_JOB_SCRIPT = "ddpd.job_file_script"


def _load_job_file(ctx: click.Context, param: click.Parameter, value: Path | None) -> Path | None:
    """Eager: the job file's keys become the defaults of the other options (flags win over them)."""
    if value is not None:
        defaults, script = job_defaults(ctx.command, value, load_job_file(value))
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
@reconnect_option
@socket_option
@click.argument("script", nargs=-1, type=click.UNPROCESSED, metavar="[-- SCRIPT ARGS...]")
def submit(idempotency_key: str | None, follow: bool, reconnect: float, socket_path: Path | None,
           script: tuple[str, ...], **options: Any) -> None:
    """Submit a job and print its id.

    Without a script, every rank runs a task's training loop. After `--`, every rank runs an
    unmodified torchrun script (or, with -m, a module) with its arguments. With -f, the job
    file gives the options and the script; what the command line gives wins.
    """
    script = script or click.get_current_context().meta.get(_JOB_SCRIPT, ())
    spec = spec_from_options(options, script)
    client = client_for(socket_path)
    result = client.submit_result(spec, idempotency_key=idempotency_key)
    click.echo(result.job_id)
    if result.existing:
        note(f"job {result.job_id} was already submitted with this idempotency key")
    for notice in result.notices:
        note(f"note: {notice}", "yellow")
    if spec.oversubscribe:
        _warn_oversubscribed(client, spec.nproc)
    if follow:
        sys.stdout.flush()
        exit_for(_follow_to_end(client, result.job_id, reconnect))


def _warn_oversubscribed(client: Client, nproc: int) -> None:
    slots = client.daemon_info().cpu_slots
    if nproc > slots:
        note(f"warning: {nproc} ranks on the daemon's {slots} CPU slots (cpu_slots, --oversubscribe): they share "
             "cores and each runs slower", "yellow")


def _follow_to_end(client: Client, job_id: str, reconnect: float) -> JobView:
    writer = LogWriter(prefix=True)
    try:
        follow_logs(client, reconnect, job_id, writer.write)
    finally:
        writer.finish()
    view = retrying(client, reconnect, lambda: client.wait(job_id))
    report_final(view)
    return view


@cli.command()
@click.argument("job_id", metavar="JOB")
@click.option("--idempotency-key", default=None, metavar="KEY",
              help="Submit at most once under KEY: a retry with the same KEY prints the job it created.")
@socket_option
def resubmit(job_id: str, idempotency_key: str | None, socket_path: Path | None) -> None:
    """Submit JOB's spec again (its environment and interpreter as then) and print the new job's id."""
    result = client_for(socket_path).resubmit(job_id, idempotency_key=idempotency_key)
    click.echo(result.job_id)
    note(f"resubmitted {result.of or job_id} as {result.job_id}")
    if result.existing:
        note(f"job {result.job_id} was already submitted with this idempotency key")
    for notice in result.notices:
        note(f"note: {notice}", "yellow")


@cli.command()
@click.argument("job_id", metavar="JOB")
@click.option("--exit-code", "rank_exit_code", is_flag=True,
              help="Exit with the exit code of the rank that failed first (1 when there is none).")
@reconnect_option
@output_option
@socket_option
def wait(job_id: str, rank_exit_code: bool, reconnect: float, output: str, socket_path: Path | None) -> None:
    """Block until JOB ends; exit 0 only if it succeeded (a daemon restart meanwhile is ridden out)."""
    client = client_for(socket_path)
    view = retrying(client, reconnect, lambda: client.wait(job_id))
    if output == "json":
        print_json(view)
    note(render.final_line(view), "green" if view.state == JobState.SUCCEEDED else "red")
    cause = view.root_cause
    if rank_exit_code and view.state != JobState.SUCCEEDED and cause is not None and cause.exit_code:
        sys.exit(cause.exit_code)
    exit_for(view)


@cli.command()
@click.argument("job_id", metavar="JOB")
@output_option
@socket_option
def status(job_id: str, output: str, socket_path: Path | None) -> None:
    """Show JOB: its state, root cause and ranks."""
    view = client_for(socket_path).status(job_id)
    if output == "json":
        print_json(view)
        return
    show(render.job_detail(view, time.time()))


@cli.command("ls")
@click.option("--active", is_flag=True, help="Only jobs that have not ended.")
@click.option("--limit", type=int, default=200, show_default=True, help="Jobs per page, newest first.")
@click.option("--before", type=int, default=None, metavar="SEQ", help="The page after the one that said so.")
@output_option
@socket_option
def list_jobs(active: bool, limit: int, before: int | None, output: str, socket_path: Path | None) -> None:
    """List jobs, newest first, one page at a time (JSON: the page's jobs)."""
    client = client_for(socket_path)
    page = client.list_page(all=not active, limit=limit, before=before)
    if output == "json":
        print_json(page.jobs)
    elif not page.jobs:
        note("no active jobs" if active else "no jobs")
    else:
        show(render.jobs_table(page.jobs, time.time(), shares=_shares(client)))
    if page.next is not None:
        note(f"more jobs: ddpctl ls --limit {limit} --before {page.next}{' --active' if active else ''}")


def _shares(client: Client) -> dict[int, float] | None:
    """Each user's fair-share factor for `ls`'s share column (None: a daemon without fair share)."""
    try:
        return {v.uid: v.factor for v in client.share().users}
    except RemoteError:
        return None


@cli.command()
@click.argument("job_ids", metavar="[JOB]...", nargs=-1)
@click.option("--force", is_flag=True, help="Kill at once (SIGKILL) instead of a graceful stop.")
@click.option("--state", "states", multiple=True, metavar="STATE",
              type=click.Choice([s.value for s in JobState if not s.final], case_sensitive=False),
              help="Only jobs in this state (repeatable): QUEUED, RUNNING, ...")
@click.option("--mine", is_flag=True, help="Only my jobs (those submitted by my uid).")
@click.option("--name", "names", multiple=True, metavar="NAME", help="Only jobs of this name (repeatable).")
@output_option
@socket_option
def cancel(job_ids: tuple[str, ...], force: bool, states: tuple[str, ...], mine: bool, names: tuple[str, ...],
           output: str, socket_path: Path | None) -> None:
    """Cancel JOBs, or every job not yet ended that --state, --mine and --name select.

    A queued job ends at once; a running one is stopped (or, with --force, killed). With several
    jobs, each is cancelled in turn and the exit code is 1 if any could not be.
    """
    chosen = Selection(states={s.upper() for s in states}, mine=mine, names=set(names))
    if not job_ids and not chosen.any():
        raise click.UsageError("give the JOBs to cancel, or select them with --state, --mine or --name")
    client = client_for(socket_path)
    targets = list(job_ids) if job_ids else _selected(client, chosen)
    if not targets:
        note("no job matches: nothing cancelled")
    failed = False
    for job_id in targets:
        if job_ids and chosen.any() and not chosen.takes(client.status(job_id)):
            continue
        failed |= not _cancel_one(client, job_id, force, output, single=len(job_ids) == 1)
    if failed:
        sys.exit(EXIT_FAILED)


def _selected(client: Client, chosen: Selection) -> list[str]:
    with client.iter_jobs(all=False) as views:
        return [v.id for v in views if chosen.takes(v)]


def _cancel_one(client: Client, job_id: str, force: bool, output: str, single: bool) -> bool:
    """Cancel one job, its line on stderr; an error reply ends a lone cancel (raised), else is noted."""
    try:
        result = client.cancel(job_id, force=force)
    except RemoteError as exc:
        if single:
            raise
        error(f"{job_id}: {exc.code}: {exc.message}")
        return False
    if output == "json":
        print_json(result)
    note(render.cancel_line(result))
    return True


@cli.command("rm")
@click.argument("job_id", metavar="JOB")
@socket_option
def remove(job_id: str, socket_path: Path | None) -> None:
    """Forget an ended JOB: its record, events, logs and checkpoints."""
    note(f"removed {client_for(socket_path).remove(job_id)}")


from . import admin, observe  # noqa: E402  (their commands join the group)
from .web import command as _web  # noqa: E402, F401  (`ddpctl web`; its server loads when it runs)

complete_job_ids(cli)
__all__ = ["admin", "cli", "main", "observe", "submit"]


def main() -> None:
    cli.main(prog_name="ddpctl")
