"""The words ddpctl uses for a value, in every view (tables, the watch line, the web pages): a
duration, a size in bytes, how a process ended, a user. Plain strings, no I/O but the passwd lookup."""

from __future__ import annotations

import pwd


def duration_text(seconds: float | None, *, whole: bool = False) -> str:
    """12.3s, 4m05s, 3h07m, 2d04h (`whole`: seconds rounded, 12s)."""
    if seconds is None:
        return ""
    seconds = max(0.0, seconds)
    if whole:
        seconds = float(round(seconds))
    if seconds < 60:
        return f"{seconds:.0f}s" if whole else f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def exit_text(exit_code: int | None, signal: str | None) -> str:
    """A signal's name, else "exit N", else "" (still running)."""
    if signal:
        return signal
    if exit_code is not None:
        return f"exit {exit_code}"
    return ""


def owner_name(uid: int) -> str:
    """The user's name, or the uid where passwd has none."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def size_text(n: int) -> str:
    """Bytes as a short size: 512 B, 1.5 MiB, 12.3 GiB."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
