"""One structlog configuration: JSON lines under systemd or in a pipe, console output on a TTY."""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def parse_level(name: str) -> int:
    try:
        return _LEVELS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown log level {name!r}: use one of {', '.join(_LEVELS)}") from None


def configure_logging(level: str = "info", fmt: str = "auto", stream: TextIO | None = None) -> None:
    out = stream or sys.stderr
    use_json = fmt == "json" or (fmt == "auto" and not out.isatty())
    renderer: Any = (
        structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer(colors=out.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(parse_level(level)),
        logger_factory=structlog.PrintLoggerFactory(out),
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
