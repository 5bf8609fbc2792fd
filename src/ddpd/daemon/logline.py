"""The daemon's log for a person at a terminal: one readable line per job state change.

`ddpd serve` in a terminal would otherwise print every event (about 17 per job: each rank's
phases, the store, the pool). `keep_for_terminal` keeps what an operator reads there: each job's
state changes (its submission counted as QUEUED), the daemon's own start, reload and stop, and
every warning and error; `line` renders one event as one line (also the MESSAGE of a journald
record). Pure functions of structlog's event dict.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import structlog

_LEVEL_ORDER = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50, "exception": 40}
_DAEMON_EVENTS = frozenset({"daemon.ready", "daemon.stopping", "daemon.stopped", "daemon.reloaded",
                            "daemon.reload_failed"})
_HIDDEN = frozenset({"event", "level", "timestamp", "job_id", "attempt", "rank", "logger"})
VALUE_LIMIT = 120  # characters of one field's value in a line (the JSON log keeps them whole)
_LEFT_OUT = frozenset({"exception", "exc_info", "traceback"})  # too long for a line: `ddpctl status` has it


def kept_for_terminal(event: Mapping[str, Any]) -> bool:
    name = str(event.get("event", ""))
    level = _LEVEL_ORDER.get(str(event.get("level", "info")), 20)
    return level >= 30 or name in ("job.state_changed", "job.submitted") or name in _DAEMON_EVENTS


def keep_for_terminal(logger: Any, method: str, event: structlog.typing.EventDict) -> structlog.typing.EventDict:
    """A structlog processor: drops what `kept_for_terminal` does not keep."""
    if not kept_for_terminal(event):
        raise structlog.DropEvent
    return event


def _value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    text = text.replace("\n", "\\n")
    return text if len(text) <= VALUE_LIMIT else text[:VALUE_LIMIT - 3] + "..."


def _who(event: Mapping[str, Any]) -> str:
    parts = [str(event["job_id"])] if event.get("job_id") else []
    if event.get("rank") is not None:
        parts.append(f"rank {event['rank']}")
    return " ".join(parts)


def message(event: Mapping[str, Any]) -> str:
    """The event as one line, without time or level: what happened to which job, and why."""
    name = str(event.get("event", ""))
    data = {k: v for k, v in event.items() if k not in _HIDDEN and v is not None}
    who = _who(event)
    if name == "job.state_changed":
        text = f"{who} {data.pop('from', '?')} -> {data.pop('to', '?')}"
        reason = data.pop("reason", None)
        if reason:
            text += f" ({_value(reason)})"
        cause = data.pop("root_cause", None)
        if cause:
            text += f": {_value(cause)}"
        return text
    if name == "job.submitted":
        what = data.get("task") or " ".join(map(str, data.get("script") or [])) or "job"
        nproc = data.get("nproc", "?")
        ranks = f"{nproc} rank" + ("" if nproc == 1 else "s")
        return f"{who} QUEUED ({_value(what)}, {ranks}, uid {data.get('owner_uid', '?')})"
    fields = " ".join(f"{k}={_value(v)}" for k, v in data.items() if k not in _LEFT_OUT)
    text = " ".join(p for p in (name, who, fields) if p)
    exception = event.get("exception")
    if isinstance(exception, str) and exception:
        text += "\n" + exception.rstrip("\n")
    return text


def line(event: Mapping[str, Any]) -> str:
    """`HH:MM:SS LEVEL message` (LEVEL only for warnings and errors)."""
    stamp = str(event.get("timestamp", ""))
    clock = stamp[11:19] if len(stamp) >= 19 else stamp
    level = str(event.get("level", "info"))
    mark = f" {level.upper()}" if _LEVEL_ORDER.get(level, 20) >= 30 else ""
    return f"{clock}{mark} {message(event)}".lstrip()


def render_line(logger: Any, method: str, event: structlog.typing.EventDict) -> str:
    """A structlog renderer: `line`."""
    return line(event)
