"""ddpctl's commands that look at a job: logs, events, stacks, watch, plot and curve."""

from __future__ import annotations

import collections
import sys
import time
from pathlib import Path

import click

from ddpd.client import MAX_TAIL, AsyncClient, EventView, LogStream, QueryError, parse_rank_set, parse_since

from . import curves, render
from .group import EXIT_FAILED, cli, client_for, exit_for, report_final, socket_of, socket_option, text_output_option
from .output import LogWriter, error, note, print_json
from .reconnect import follow_logs, reconnect_option
from .stacks import show_stacks
from .watch import run_watch


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
@text_output_option("text: the logs as written; json: one object per chunk ({rank, attempt, text, stream, time}).")
@reconnect_option
@socket_option
def logs(job_id: str, rank_set: str | None, attempt: int | None, follow: bool, tail: int | None, since: str | None,
         stream: LogStream, timestamps: bool, no_prefix: bool, output: str, reconnect: float,
         socket_path: Path | None) -> None:
    """Print the logs of JOB (stdout and stderr of its ranks, by the time the daemon received them)."""
    try:
        ranks = parse_rank_set(rank_set) if rank_set is not None else None
    except QueryError as exc:
        raise click.BadParameter(str(exc), param_hint="--rank") from None
    try:
        start = parse_since(since, time.time()) if since is not None else None
    except QueryError as exc:
        raise click.BadParameter(str(exc), param_hint="--since") from None
    one = ranks is not None and len(ranks) == 1
    writer = LogWriter(prefix=not one and not no_prefix, timestamps=timestamps)
    write = print_json if output == "json" else writer.write
    client = client_for(socket_path)
    query = {"attempt": attempt, "ranks": ranks, "stream": stream, "tail": tail, "since": start}
    try:
        if follow:
            follow_logs(client, reconnect, job_id, write, **query)
            return
        with client.logs(job_id, **query) as chunks:  # type: ignore[arg-type]
            for chunk in chunks:
                write(chunk)
    finally:
        writer.finish()


@cli.command()
@click.argument("job_id", metavar="[JOB]", required=False)
@click.option("-f", "--follow", is_flag=True, help="Keep following new events (after the last 10: --tail).")
@click.option("--since", type=int, default=None, metavar="SEQ", help="Only events after this sequence number.")
@click.option("--tail", type=click.IntRange(min=0), default=None, metavar="N",
              help="Only the last N events so far (then follow, with -f) [default with -f: 10].")
@text_output_option("text: one line per event; json: one JSON object per line.")
@socket_option
def events(job_id: str | None, follow: bool, since: int | None, tail: int | None, output: str,
           socket_path: Path | None) -> None:
    """Print the events of JOB (or of every job)."""
    client = client_for(socket_path)
    if tail is None and follow and since is None:
        tail = FOLLOW_TAIL
    start = since or 0
    if tail is not None:  # the history up to now, of which only the last N are shown
        with client.events(job_id, since=start) as stream:
            last = collections.deque(stream, maxlen=tail) if tail else collections.deque(stream, maxlen=1)
        for event in last if tail else ():
            _print_event(event, output)
        start = last[-1].seq if last else start
        if not follow:
            return
    with client.events(job_id, follow=follow, since=start) as stream:
        for event in stream:
            _print_event(event, output)


FOLLOW_TAIL = 10  # events shown before following, unless --tail or --since says otherwise


def _print_event(event: EventView, output: str) -> None:
    if output == "json":
        print_json(event)
    else:
        sys.stdout.write(render.event_line(event) + "\n")
        sys.stdout.flush()


@cli.command()
@click.argument("job_id", metavar="JOB")
@click.option("--rank", type=int, default=None, help="Only this rank [default: every rank].")
@click.option("--native", is_flag=True, help="Native frames too (py-spy, where the daemon has it).")
@click.option("--all-threads", is_flag=True, help="ddpd's own threads too (ddpd-dump, ddpd-heartbeat).")
@text_output_option("text: each distinct stack once, with its ranks; json: the daemon's result.")
@socket_option
def stacks(job_id: str, rank: int | None, native: bool, all_threads: bool, output: str,
           socket_path: Path | None) -> None:
    """Show where every thread of JOB's ranks is now; the job keeps running."""
    show_stacks(client_for(socket_path), job_id, rank, native, output == "json", all_threads)


@cli.command()
@click.argument("job_id", metavar="[JOB]", required=False)
@text_output_option("text: a live view; json: one JSON snapshot per refresh (the job, or the list of jobs).")
@reconnect_option
@socket_option
def watch(job_id: str | None, output: str, reconnect: float, socket_path: Path | None) -> None:
    """A live view of JOB (or of all jobs): state, ranks, step, loss, heartbeat age.

    It refreshes on every event of the daemon's event stream, and once a second for the
    heartbeat ages. It runs until Ctrl-C (exit 0) or, with JOB, until JOB ends (exit 0 if it
    succeeded, else 1).
    """
    view = run_watch(AsyncClient(socket_of(socket_path)), job_id, as_json=output == "json", reconnect=reconnect)
    if view is not None:
        if output != "json":
            report_final(view)
        exit_for(view)


@cli.command()
@click.argument("job_id", metavar="JOB")
@click.option("--png", type=click.Path(path_type=Path, dir_okay=False), default=None, metavar="FILE",
              help="Write the plot to FILE as a PNG (needs matplotlib: the extra 'plot').")
@click.option("--size", default=None, metavar="WxH",
              help="Size of the plot: pixels of the PNG [800x480], or characters of the terminal plot "
              "[the terminal's].")
@socket_option
def plot(job_id: str, png: Path | None, size: str | None, socket_path: Path | None) -> None:
    """Draw JOB's loss curve against the step: in the terminal, or (--png) as a picture."""
    try:
        pixels = curves.parse_size(size) if png is not None and size else curves.PNG_SIZE
        cols, rows = curves.parse_terminal_size(size) if png is None and size else (None, None)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--size") from None
    curve = client_for(socket_path).curve(job_id)
    if not curves.losses(curve):
        error(f"job {job_id} has no loss recorded ({curve.state})")
        sys.exit(EXIT_FAILED)
    if png is None:
        sys.stdout.write(curves.terminal_plot(curve, cols, rows, color=sys.stdout.isatty()) + "\n")
        return
    try:
        curves.write_png(curve, png, pixels)
    except curves.PlotUnavailable as exc:
        error(str(exc))
        sys.exit(EXIT_FAILED)
    note(f"wrote {png}")


@cli.command("curve")
@click.argument("job_id", metavar="JOB")
@click.option("-o", "--output", type=click.Choice(["csv", "json"]), default="csv", show_default=True,
              help="csv: a header and one row per point; json: the curve and its points as one object.")
@socket_option
def curve(job_id: str, output: str, socket_path: Path | None) -> None:
    """Export JOB's training curve: time, step, loss and steps per second, oldest first."""
    view = client_for(socket_path).curve(job_id)
    if output == "json":
        print_json({"job_id": view.job_id, "state": view.state, "steps": view.steps, "stride": view.stride,
                    "backwards": view.backwards, "nonfinite": view.nonfinite, "points": curves.to_rows(view)})
    else:
        sys.stdout.write(curves.to_csv(view))


# `ddpctl metrics`, the command's name before it took the feature's (curve, as the request and the
# store call it; "metrics" is the Prometheus endpoint's): still typed in scripts, not listed
cli.add_command(click.Command("metrics", params=curve.params, callback=curve.callback, hidden=True,
                              help=curve.help))


