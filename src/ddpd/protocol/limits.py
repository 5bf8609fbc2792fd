"""Bounds shared by every side: how long a stored text may be, and how it is cut."""

from __future__ import annotations

from typing import Any

TEXT_LIMIT = 8 * 1024  # a stored or shown message, detail or traceback (the whole text stays in the rank log)


def clip_text(text: str, limit: int = TEXT_LIMIT) -> str:
    """`text` if it fits in `limit` characters, else its head and tail around a note of what was cut.

    The head says what failed, the tail where: both are kept.
    """
    if len(text) <= limit:
        return text
    note = "\n[... {} characters cut; the whole text is in the rank log ...]\n"
    keep = max(0, limit - len(note) - 8)
    head, tail = keep // 2, keep - keep // 2
    cut = len(text) - head - tail
    return text[:head] + note.format(cut) + (text[-tail:] if tail else "")


def clip_value(value: Any, limit: int = TEXT_LIMIT) -> Any:
    """`value` with every string in it (in lists and maps, recursively) clipped to `limit`."""
    if isinstance(value, str):
        return clip_text(value, limit)
    if isinstance(value, dict):
        return {k: clip_value(v, limit) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [clip_value(v, limit) for v in value]
    return value
