"""Bounds shared by every side: how long a stored text may be, and how it is cut."""

from __future__ import annotations

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
