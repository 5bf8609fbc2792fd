"""One structlog configuration, in the format the place it goes to wants.

- `human` (the default on a terminal): one readable line per job state change, warnings and
  errors (`logline`); `console`: every event, structlog's console renderer;
- `journald` (the default when stderr is the journal stream systemd connected, JOURNAL_STREAM):
  one native journal record per event, with its PRIORITY and JOB_ID/ATTEMPT/RANK fields (`journald`);
- `json` (the default in a pipe or a file): one JSON object per line, every event.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any, TextIO

import structlog

from .journald import JournalLoggerFactory, journal_socket, render_record, stream_is_journal
from .logline import keep_for_terminal, render_line

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def parse_level(name: str) -> int:
    try:
        return _LEVELS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown log level {name!r}: use one of {', '.join(_LEVELS)}") from None


FORMATS = ("auto", "json", "console", "human", "journald")


def resolve_format(fmt: str, out: TextIO) -> str:
    """The format `auto` means for this stream: journald, human on a terminal, else json."""
    if fmt != "auto":
        return fmt
    if stream_is_journal(out):
        return "journald"
    return "human" if out.isatty() else "json"


def configure_logging(level: str = "info", fmt: str = "auto", stream: TextIO | None = None,
                      journal: Path | None = None) -> None:
    """`journal`: journald's socket (default: $DDPD_JOURNAL_SOCKET, else systemd's)."""
    out = stream or sys.stderr
    fmt = resolve_format(fmt, out)
    processors: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="%H:%M:%S" if fmt == "human" else "iso", utc=fmt != "human"),
        structlog.processors.format_exc_info,
    ]
    factory: Any = structlog.PrintLoggerFactory(out)
    if fmt == "journald":
        processors.append(render_record)
        factory = JournalLoggerFactory(journal or journal_socket(), out)
    elif fmt == "human":
        processors += [keep_for_terminal, render_line]
    elif fmt == "console":
        processors.append(structlog.dev.ConsoleRenderer(colors=out.isatty()))
    else:
        processors.append(structlog.processors.JSONRenderer())
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(parse_level(level)),
        logger_factory=factory,
        cache_logger_on_first_use=False,
    )
    _flush_early()


def set_level(level: str) -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(parse_level(level)))


_early: list[tuple[str, dict[str, Any]]] = []


def warn_early(event: str, **fields: Any) -> None:
    """A warning that may come before logging is configured (while the config is read at start):
    logged at once when it is, else kept until `configure_logging`."""
    if structlog.is_configured():
        structlog.get_logger("ddpd").warning(event, **fields)
    else:
        _early.append((event, fields))


def _flush_early() -> None:
    while _early:
        event, fields = _early.pop(0)
        structlog.get_logger("ddpd").warning(event, **fields)
