"""A failing rank's traceback as its user reads it: from the user's first frame.

The rank log keeps the full traceback. The Failure frame (what `status`, `wait` and `--follow`
show) carries it with its head trimmed: the leading frames of ddpd itself (the worker's bootstrap,
the task loop, the script runner) and of runpy are left out, so it starts at the script's module
code or the task's own function. Frames below the user's first one are kept as they are, and so
are chained exceptions. A failure with no user frame (raised in ddpd itself) keeps every frame.
"""

from __future__ import annotations

import os
import runpy
import traceback
from types import TracebackType

import ddpd

_DDPD = os.path.dirname(ddpd.__file__) + os.sep
_RUNPY = (runpy.__file__, "<frozen runpy>")


def is_runner(filename: str) -> bool:
    """A frame of what runs the user's code: ddpd's own modules or runpy."""
    return filename.startswith(_DDPD) or filename in _RUNPY


def user_frames(tb: TracebackType | None) -> TracebackType | None:
    """The traceback from its first frame outside ddpd and runpy (all of it when there is none)."""
    head = tb
    while head is not None and is_runner(head.tb_frame.f_code.co_filename):
        head = head.tb_next
    return head if head is not None else tb


def user_traceback(exc: BaseException) -> str:
    """`exc` formatted as the interpreter would, with the runner's frames trimmed from its head."""
    return "".join(traceback.format_exception(type(exc), exc, user_frames(exc.__traceback__)))
