"""A script that finishes, then holds the GIL forever on the rank's way out: a profile hook (as a
tracer or a leftover library hook might be) that blocks in a C call without releasing the GIL when
the rank calls ``os._exit``. Its heartbeat thread starves; the daemon must say the rank finished its
script and is stuck at exit, and where.
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Any

_libc = ctypes.PyDLL(None)  # PyDLL: the GIL stays held during its calls


def hold(frame: Any, event: str, arg: Any) -> None:
    if event == "c_call" and arg is os._exit:
        while True:  # pause() returns on each signal (the daemon's SIGUSR1 dump): hold on
            _libc.pause()


print("script done", flush=True)
sys.setprofile(hold)
