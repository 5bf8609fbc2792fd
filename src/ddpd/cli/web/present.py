"""The daemon's answers as the pages show them: rows of plain strings for the templates, and the
JSON of the API (the daemon's own shapes, with the owner's name beside the uid).

Everything here is text the templates escape; nothing is marked safe but the chart, which `chart`
draws from numbers only.
"""

from __future__ import annotations

import datetime
import functools
import pwd
from typing import Any

import jinja2
import msgspec
from markupsafe import Markup

from ddpd.client import (
    CurveResult,
    EventView,
    GpuView,
    JobState,
    JobView,
    NodeView,
    PoolServerView,
    RankView,
    RootCause,
    local_ranks,
    span_text,
)

from .. import curves, render
from ..daemon_view import gpu_name, rank_gpu_text, server_key
from ..words import duration_text, size_text
from . import chart
from .data import DaemonPage, JobDetail

FINAL = render.FINAL
STATES = [s.value for s in JobState]


@functools.lru_cache(maxsize=4096)
def owner_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def environment() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.PackageLoader("ddpd.cli.web", "templates"), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters["owner"] = owner_name
    env.filters["clock"] = clock
    return env


def clock(ts: float | None) -> str:
    if ts is None:
        return ""
    return datetime.datetime.fromtimestamp(ts).isoformat(sep=" ", timespec="seconds")


def resources(job: JobView) -> str:
    """`2 x CPU`, `4 x 1 GPU`: ranks and what each one gets."""
    spec = job.spec
    each = f"{spec.gpus_per_rank:g} GPU" if spec.gpus_per_rank else "CPU"  # device cuda implies a GPU
    return f"{spec.nproc} x {each}"


def duration(job: JobView, now: float) -> str:
    if job.started_at is None:
        return ""
    end = job.finished_at if job.finished_at is not None else now
    return duration_text(end - job.started_at)


def job_row(job: JobView, now: float) -> dict[str, Any]:
    return {"id": job.id, "name": job.name, "owner": owner_name(job.owner_uid), "state": job.state,
            "position": job.queue_position, "resources": resources(job), "attempt": job.attempt,
            "age": duration_text(now - job.submitted_at, whole=True), "duration": duration(job, now),
            "cause": cause_short(job) if job.state in FINAL else ""}


def cause_short(job: JobView) -> str:
    cause = job.root_cause
    if cause is None:
        return job.reason or ""
    parts = [cause.reason]
    if cause.rank is not None:
        parts.append(f"rank {cause.rank}")
    if cause.signal or cause.exit_code is not None:
        parts.append(cause.signal or f"exit {cause.exit_code}")
    if cause.error:
        parts.append(cause.error)
    return ": ".join(parts)


def cause_rows(cause: RootCause | None) -> list[tuple[str, str]]:
    if cause is None:
        return []
    rows = [("root cause", cause.reason)]
    for key, value in (("rank", cause.rank), ("attempt", cause.attempt), ("signal", cause.signal),
                       ("exit code", cause.exit_code), ("phase", cause.phase), ("error", cause.error),
                       ("message", cause.message), ("detail", cause.detail)):
        if value is not None:
            rows.append((key, str(value)))
    if cause.ranks:
        rows.append(("ranks", ", ".join(map(str, cause.ranks))))
    return rows


def rank_row(rank: RankView) -> dict[str, Any]:
    exit_text = rank.signal or ("" if rank.exit_code is None else f"exit {rank.exit_code}")
    return {"rank": rank.rank, "attempt": rank.attempt, "state": rank.state,
            "pid": "" if rank.pid is None else str(rank.pid), "step": rank.step,
            "loss": "" if rank.loss is None else f"{rank.loss:.4g}",
            "heartbeat": "" if rank.heartbeat_age is None else f"{rank.heartbeat_age:.1f}s ago",
            "exit": exit_text, "gpus": rank_gpu_text(rank.gpus) if rank.gpus else ""}


def node_row(node: NodeView) -> dict[str, Any]:
    return {"node": f"{node.node_rank}{'*' if node.local else ''}", "host": node.host, "daemon": node.daemon,
            "state": node.state, "ranks": span_text(node.ranks), "detail": node.detail}


def log_ranks(job: JobView) -> list[int]:
    """The ranks whose logs this daemon shows, by global rank: its node's (a multi-node job), else all."""
    mine = local_ranks(job.nodes)
    if mine is not None:
        return mine
    return sorted({r.rank for r in job.ranks}) if job.nodes else list(range(job.spec.nproc))


def progress(curve: CurveResult | None, final: bool) -> dict[str, str]:
    """steps/s, ETA, last loss and step of the curve, as words ("" where unknown)."""
    if curve is None:
        return {"rate": "", "eta": "", "loss": "", "step": ""}
    rate, eta = curves.rate_and_eta(curve)
    points = curves.losses(curve)
    last = curve.points[-1].step if curve.points else None
    return {"rate": "" if rate is None else f"{rate:.3g} steps/s",
            "eta": "" if eta is None or final else f"ETA {duration_text(eta, whole=True)}",
            "loss": f"loss {points[-1][1]:.4g}" if points else "",
            "step": "" if last is None else f"step {last}" + ("" if curve.steps is None else f" of {curve.steps}")}


def curve_svg(curve: CurveResult | None) -> Markup:
    """The chart, marked safe: `chart` draws it from numbers only."""
    return Markup(chart.loss_svg(curve if curve is not None else CurveResult(job_id="", state="", points=[])))


def spec_text(job: JobView) -> str:
    return msgspec.json.format(msgspec.json.encode(job.spec), indent=2).decode()


def event_row(event: EventView) -> dict[str, Any]:
    detail = " ".join(f"{k}={v if isinstance(v, str) else msgspec.json.encode(v).decode()}"
                      for k, v in event.data.items())
    where = " ".join(p for p in ("" if event.attempt is None else f"attempt {event.attempt}",
                                 "" if event.rank is None else f"rank {event.rank}") if p)
    return {"seq": event.seq, "time": clock(event.ts), "kind": event.kind, "where": where, "detail": detail[:2000]}


def shown_event(event: EventView) -> bool:
    return event.kind != "rank.progress"  # a few a second, live only: the curve shows them


def job_context(detail: JobDetail, now: float, viewer: int) -> dict[str, Any]:
    job = detail.job
    final = job.state in FINAL
    return {"job": job, "row": job_row(job, now), "causes": cause_rows(job.root_cause),
            "traceback": (job.root_cause.traceback or "") if job.root_cause else "",
            "ranks": [rank_row(r) for r in job.ranks], "progress": progress(detail.curve, final),
            "nodes": [node_row(n) for n in job.nodes], "log_ranks": log_ranks(job),
            "chart": curve_svg(detail.curve), "final": final, "spec": spec_text(job),
            "may_stack": viewer in (0, job.owner_uid) and job.state == "RUNNING",
            "may_cancel": not final}


def _size(n: int | None) -> str:
    return "?" if n is None else size_text(n)


def gpu_row(g: GpuView) -> dict[str, Any]:
    return {"index": gpu_name(g.index, g.mig, g.uuid), "name": g.name,
            "memory": f"{_size(g.memory_used)} of {_size(g.memory_total)}",
            "utilization": "" if g.utilization is None else f"{g.utilization}%",
            "jobs": ", ".join(g.jobs) or "free", "others": g.other_processes}


def server_row(s: PoolServerView) -> dict[str, Any]:
    """A fork server: its key (its user alone where the daemon keeps the rest from the viewer), pid,
    state, Pss (MiB, "?" unknown), spares, forks served, idle time."""
    return {"key": server_key(s), "pid": "" if s.pid is None else s.pid, "state": s.state,
            "pss": "?" if s.pss is None else f"{s.pss / (1 << 20):.0f} MiB", "spares": s.spares, "forks": s.forks,
            "idle": duration_text(s.idle, whole=True)}


def daemon_context(page: DaemonPage) -> dict[str, Any]:
    info = page.info
    return {"info": info, "uptime": duration_text(info.uptime),
            "load": " ".join(f"{v:.2f}" for v in page.load), "cpus": page.cpus,
            "gpus": [gpu_row(g) for g in info.gpu_devices], "servers": [server_row(s) for s in info.pool_servers],
            "queues": [{"user": owner_name(q.uid), "queued": q.queued, "running": q.running, "ranks": q.ranks,
                        "gpus": f"{q.gpus:g}"} for q in page.queues]}


def job_json(job: JobView) -> dict[str, Any]:
    out: dict[str, Any] = msgspec.to_builtins(job)
    out["owner"] = owner_name(job.owner_uid)
    return out
