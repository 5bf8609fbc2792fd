"""How ddpctl shows jobs: the job table, a job's detail (header, root cause, nodes, ranks), its final
line, a cancel's outcome and an event line. Plain strings and rich tables, no I/O. The words for
values are in `words`; the daemon's grid and the GPUs in `daemon_view`."""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping

import msgspec
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from ddpd.client import CancelResult, EventView, JobState, JobView, RootCause, local_ranks, span_text

from .daemon_view import rank_gpu_text
from .words import duration_text, exit_text, owner_name

FINAL = frozenset(s.value for s in JobState if s.final)

STATE_STYLES = {
    "QUEUED": "dim",
    "STARTING": "cyan",
    "RUNNING": "bold cyan",
    "RESTARTING": "yellow",
    "PREEMPTED": "magenta",
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


def _state(state: str) -> Text:
    return Text(state, style=STATE_STYLES.get(state, ""))


def _cause_short(view: JobView) -> str:
    cause = view.root_cause
    if cause is None:
        return view.reason or ""
    parts = [cause.reason]
    if cause.rank is not None:
        parts.append(f"rank {cause.rank}")
    ended = exit_text(cause.exit_code, cause.signal)
    if ended:
        parts.append(ended)
    if cause.error:
        parts.append(cause.error)
    return ": ".join(parts)


def _cause_lines(cause: RootCause, traceback_lines: int = 12) -> list[tuple[str, str]]:
    rows = [("root cause", cause.reason)]
    if cause.rank is not None:
        rows.append(("rank", str(cause.rank)))
    if cause.attempt is not None:
        rows.append(("attempt", str(cause.attempt)))
    ended = exit_text(cause.exit_code, cause.signal)
    if ended:
        rows.append(("exit", ended))
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


def final_line(view: JobView) -> str:
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
    if view.queue_position is not None:
        grid.add_row("queue", Text(f"#{view.queue_position} in line"))
    if view.pending:
        grid.add_row("pending", Text(view.pending))
    grid.add_row("owner", Text(owner_name(view.owner_uid)))
    grid.add_row("nproc", Text(str(view.spec.nproc)))
    grid.add_row("attempt", Text(str(view.attempt)))
    if view.started_at is not None:
        end = view.finished_at if view.finished_at is not None else now
        grid.add_row("duration", Text(duration_text(end - view.started_at)))
    elif view.finished_at is not None:  # it ended in the queue (cancelled, a dependency that failed)
        grid.add_row("ended", Text(f"without running, {duration_text(view.finished_at - view.submitted_at)} "
                                   "after it was submitted"))
    else:
        grid.add_row("queued for", Text(duration_text(now - view.submitted_at)))
    if view.spec.after:
        grid.add_row("after", Text(", ".join(view.spec.after)))
    if view.waiting_on:
        grid.add_row("waiting on", Text(", ".join(view.waiting_on)))
    if view.reason:
        grid.add_row("reason", Text(view.reason))
    if view.root_cause is not None:
        for key, value in _cause_lines(view.root_cause):
            grid.add_row(key, Text(value))
    return grid


def ranks_table(view: JobView, title: str | None = None) -> Table:
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
    with_gpus = any(rank.gpus for rank in view.ranks)
    if with_gpus:
        table.add_column("gpu")
    replaced = any(rank.replacements for rank in view.ranks)  # hot replacement: shown once it happened
    if replaced:
        table.add_column("replaced", justify="right")
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
            Text(exit_text(rank.exit_code, rank.signal)),
            *([Text(rank_gpu_text(rank.gpus))] if with_gpus else []),
            *([Text(f"{rank.replacements}x" if rank.replacements else "")] if replaced else []),
        )
    return table


def state_text(view: JobView) -> Text:
    """The state, with the place in line of a queued job: "QUEUED #3"."""
    text = _state(view.state)
    if view.queue_position is not None:
        text.append(f" #{view.queue_position}")
    return text


def job_detail(view: JobView, now: float) -> RenderableType:
    parts: list[RenderableType] = [_job_header(view, now)]
    if view.nodes:
        parts.append(nodes_table(view))
    if view.ranks:
        parts.append(ranks_table(view))
    return Group(*parts)


NODE_STATE_STYLES = {"lost": "bold red", "unreachable": "bold red", "unknown": "dim", "stopped": "yellow"}


def nodes_table(view: JobView) -> Table:
    """A multi-node job's nodes: host, node rank, daemon, state and global ranks (this node marked *),
    and which ranks this daemon's per-rank commands (logs, stacks) show."""
    table = Table(title="nodes", title_justify="left")
    for name in ("node", "host", "daemon", "state", "ranks", "detail"):
        table.add_column(name, justify="right" if name == "node" else "left", overflow="fold")
    for node in view.nodes:
        style = NODE_STATE_STYLES.get(node.state) or STATE_STYLES.get(node.state.upper(), "")
        table.add_row(Text(f"{node.node_rank}{'*' if node.local else ''}"), Text(node.host), Text(node.daemon),
                      Text(node.state, style=style), Text(span_text(node.ranks)), Text(node.detail))
    mine = local_ranks(view.nodes)
    if mine and len(view.nodes) > 1:
        table.caption = f"logs and stacks here: ranks {span_text(mine)}; the others' on their own node's daemon"
        table.caption_justify = "left"
    return table


def jobs_table(views: Iterable[JobView], now: float, progress: bool = False, title: str | None = None,
               shares: Mapping[int, float] | None = None) -> Table:
    """The jobs, a row each; `progress`: with each job's step (of its target) and ETA; `shares`: with
    the owner's fair-share factor (`ddpctl share`)."""
    table = Table(title=title, title_justify="left")
    table.add_column("id", no_wrap=True)
    table.add_column("name", overflow="fold")
    table.add_column("owner")
    table.add_column("state")
    table.add_column("nproc", justify="right")
    table.add_column("attempt", justify="right")
    table.add_column("age", justify="right")
    table.add_column("duration", justify="right")
    if progress:
        table.add_column("step", justify="right")
        table.add_column("ETA", justify="right")
    if shares is not None:
        table.add_column("share", justify="right")
    table.add_column("root cause / pending", overflow="fold")
    for view in views:
        duration = ""
        if view.started_at is not None:
            end = view.finished_at if view.finished_at is not None else now
            duration = duration_text(end - view.started_at)
        extra = [Text(t) for t in step_and_eta(view, now)] if progress else []
        if shares is not None:
            factor = shares.get(view.owner_uid)
            extra.append(Text("" if factor is None or view.state in FINAL else f"{factor:.2f}"))
        table.add_row(
            Text(view.id),
            Text(view.name),
            Text(owner_name(view.owner_uid)),
            state_text(view),
            Text(str(view.spec.nproc)),
            Text(str(view.attempt)),
            Text(duration_text(now - view.submitted_at)),
            Text(duration),
            *extra,
            Text(_last_column(view)),
        )
    return table


def step_and_eta(view: JobView, now: float) -> tuple[str, str]:
    """A running job's step ("120/400"; a script's has no target) and the time left at its average rate
    since it started ("" where unknown)."""
    step = max((r.step for r in view.ranks), default=0)
    if view.state in FINAL or view.started_at is None or not view.ranks:
        return "", ""
    target = view.spec.steps if view.spec.script is None else None
    text = f"{step}/{target}" if target else str(step)
    elapsed = now - view.started_at
    if not target or step <= 0 or elapsed <= 0:
        return text, ""
    return text, duration_text(max(0, target - step) * elapsed / step, whole=True)


def _last_column(view: JobView) -> str:
    """A failed job's root cause, a queued one's pending reason, else nothing."""
    if view.state == JobState.QUEUED:
        return view.pending or ""
    return _cause_short(view) if view.state in FINAL and view.state != JobState.SUCCEEDED else ""


def event_line(event: EventView) -> str:
    when = datetime.datetime.fromtimestamp(event.ts).isoformat(sep=" ", timespec="milliseconds")
    parts = [when, f"#{event.seq}" if event.seq else "live", event.kind]  # live: progress, never stored
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


def cancel_line(result: CancelResult) -> str:
    """What a cancel did, in words: "cancelled j3 (was QUEUED)", "stopping j3: ...", "killing j3"."""
    job = result.job
    match result.action:
        case "cancelled":
            return f"cancelled {job.id} (was QUEUED)"  # only a job not yet started ends at once
        case "stopping":
            grace = job.spec.timeouts.kill_grace
            within = f"{grace:g}s" if grace is not None else "the daemon's kill grace"
            return f"stopping {job.id}: ranks asked to stop, teardown within {within}"
        case "killing":
            return f"killing {job.id}"
        case other:
            return f"{other} {job.id} ({job.state})"
