"""The rank's stacks on demand, and NCCL's flight recorder on a hang.

`current_stacks` runs on the reader thread while the main thread goes on: every other thread's
current stack from ``sys._current_frames()``, formatted as a traceback (innermost frame last),
bounded (STACK_THREADS threads of STACK_TEXT characters each, names clipped). The launcher's own
frames (runpy, and the ddpd bootstrap under a script's ``run_path``) are left off the main thread:
it starts at the job's first frame.

`dump_flight_recorder` writes torch's NCCL flight recorder beside the rank logs (the path the
daemon set in ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``) where it applies: an initialized NCCL process
group on a torch that has the recorder; otherwise it says why not. The worker does so on the
daemon's hang dump (SIGUSR1, or the DumpStacks frame).
"""

from __future__ import annotations

import os
import sys
import threading
import traceback
from types import FrameType

from ddpd.protocol.channel import STACK_TEXT, STACK_THREADS, THREAD_NAME, Stacks, ThreadStack
from ddpd.protocol.limits import clip_text

MAX_FRAMES = 200  # innermost frames of one thread formatted at most
_RUNPY = (f"{os.sep}runpy.py", "<frozen runpy>")
TRACE_ENV = ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_FR_DUMP_TEMP_FILE")


def format_stack(frame: FrameType) -> str:
    """A thread's stack as traceback text; the frames up to the last runpy one are the launcher's."""
    summary = traceback.extract_stack(frame, limit=MAX_FRAMES)
    last_runpy = max((i for i, f in enumerate(summary) if f.filename.endswith(_RUNPY)), default=-1)
    if last_runpy + 1 < len(summary):
        summary = traceback.StackSummary.from_list(summary[last_runpy + 1:])
    return clip_text("".join(summary.format()), STACK_TEXT)


def current_stacks(request: int) -> Stacks:
    """Every thread's stack but the calling one's (the main thread first)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    me = threading.get_ident()
    frames = sys._current_frames()
    idents = sorted((i for i in frames if i != me), key=lambda i: (i != main, names.get(i, ""), i))
    threads = [
        ThreadStack(name=clip_text(names.get(i, f"thread {i:#x}"), THREAD_NAME), main=i == main,
                    stack=format_stack(frames[i]))
        for i in idents[:STACK_THREADS]
    ]
    return Stacks(request=request, threads=threads, omitted=max(0, len(idents) - STACK_THREADS))


def dump_flight_recorder() -> str:
    """Dump NCCL's flight recorder to its file beside the rank logs; what was done, in words."""
    prefix = next((v for k in TRACE_ENV if (v := os.environ.get(k))), "")
    if not prefix:
        return "flight recorder: not enabled for this job"
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return "flight recorder: no process group"
    backend = str(dist.get_backend())
    if backend != "nccl":
        return f"flight recorder: does not apply to the {backend} backend (NCCL only)"
    try:
        import torch._C._distributed_c10d as c10d

        dump = getattr(c10d, "_dump_nccl_trace", None) or getattr(c10d, "_dump_fr_trace", None)
        if dump is None:
            return "flight recorder: not in this build of torch"
        data: bytes = dump()
    except Exception as exc:  # an older or CPU-only build of torch, or the recorder refused
        return f"flight recorder: not available ({exc!r})"
    path = f"{prefix}{dist.get_rank()}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    return f"flight recorder: dumped to {path}"
