"""Where ddpctl writes: data (ids, tables, JSON, logs) to stdout, status lines and errors to stderr.

Rich consoles never interpret markup in data.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import msgspec
from rich.console import Console, RenderableType
from rich.text import Text

from ddpd.client import LogChunk, format_stamp


def stdout() -> Console:
    width = None if sys.stdout.isatty() or "COLUMNS" in os.environ else 200
    return Console(markup=False, highlight=False, emoji=False, width=width)


def show(renderable: RenderableType) -> None:
    """Print a table or a view on stdout: as Rich draws it on a terminal; piped, each line without the
    padding Rich adds to fill the width."""
    console = stdout()
    if console.is_terminal:
        console.print(renderable)
        return
    with console.capture() as captured:
        console.print(renderable)
    sys.stdout.write("".join(line.rstrip() + "\n" for line in captured.get().splitlines()))
    sys.stdout.flush()


def stderr() -> Console:
    return Console(stderr=True, markup=False, highlight=False, emoji=False)


def note(message: str, style: str = "") -> None:
    stderr().print(Text(message, style=style), soft_wrap=True)


def error(message: str) -> None:
    stderr().print(Text(f"ddpctl: error: {message}", style="red"), soft_wrap=True)


def print_json(value: Any) -> None:
    sys.stdout.write(msgspec.json.encode(value).decode() + "\n")
    sys.stdout.flush()


class LogWriter:
    """Writes log chunks to stdout as they come, each line prefixed with its rank when asked, and with
    the time the daemon received it (ISO-8601, UTC) with `timestamps`."""

    def __init__(self, prefix: bool, timestamps: bool = False) -> None:
        self._prefix = prefix
        self._timestamps = timestamps
        self._partial: dict[tuple[int, int, str], str] = {}

    def _head(self, chunk: LogChunk) -> str:
        head = f"{format_stamp(chunk.time)} " if self._timestamps and chunk.time is not None else ""
        return head + (f"[rank {chunk.rank}] " if self._prefix else "")

    def write(self, chunk: LogChunk) -> None:
        if not self._prefix and not self._timestamps:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            return
        key = (chunk.attempt, chunk.rank, chunk.stream or "")
        lines = (self._partial.pop(key, "") + chunk.text).split("\n")
        if lines[-1]:
            self._partial[key] = lines[-1]
        head = self._head(chunk)
        sys.stdout.write("".join(f"{head}{line}\n" for line in lines[:-1]))
        sys.stdout.flush()

    def finish(self) -> None:
        for (_, rank, _), rest in sorted(self._partial.items()):
            sys.stdout.write(f"[rank {rank}] {rest}\n" if self._prefix else f"{rest}\n")
        self._partial.clear()
        sys.stdout.flush()
