"""`stacks`: the current stack of every thread of a running attempt's ranks, the job running on.

Each live rank is asked on its channel (`AskStacks`); its reader thread answers with a `Stacks`
frame while the main thread goes on. The wait is bounded (STACKS_WAIT): a rank that does not
answer (its reader thread cannot run: a native call holding the GIL, a stopped process) is
reported as such, with py-spy's dump of it where the daemon has py-spy. With `native`, py-spy's
native dump is added for every rank; without py-spy that is said, and the Python stacks are shown.

`group_stacks` shows each distinct (thread, stack) once with the ranks that share it, the main
threads first; `fit` keeps the reply under the frame limit (stacks clipped shorter, then groups
left out, each said in the result's note).
"""

from __future__ import annotations

import itertools
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import anyio
import msgspec
import structlog

from ...protocol import MAX_FRAME, RankState
from ...protocol.channel import AskStacks, Stacks
from ...protocol.control import RankStacks, StackGroup, StacksResult
from ...protocol.limits import TEXT_LIMIT, clip_text
from .ranks import RankHandle, StacksAsked

log = structlog.get_logger("ddpd")

STACKS_WAIT = 2.0  # seconds a rank has to answer
PY_SPY_WAIT = 10.0  # seconds one py-spy dump may take
PY_SPY_AT_ONCE = 4  # py-spy processes at once, over all requests
NATIVE_TEXT = 4 * TEXT_LIMIT  # characters of one py-spy dump
REPLY_BUDGET = MAX_FRAME // 2  # bytes of a result (JSON), well under the reply frame limit
CLIPS = (TEXT_LIMIT, 2048, 512, 128)  # stack lengths tried, longest first, until the result fits
NO_PY_SPY = "py-spy is not installed where the daemon runs (pip install 'ddpd[debug]'): Python stacks only"

_requests = itertools.count(1)
_py_spy_limiter: anyio.CapacityLimiter | None = None


def _limiter() -> anyio.CapacityLimiter:
    """One limiter for the daemon's py-spy processes (made on first use, inside the event loop)."""
    global _py_spy_limiter
    if _py_spy_limiter is None:
        _py_spy_limiter = anyio.CapacityLimiter(PY_SPY_AT_ONCE)
    return _py_spy_limiter


def find_py_spy() -> str | None:
    """py-spy on the daemon's PATH or beside its interpreter (a virtual environment's bin)."""
    found = shutil.which("py-spy")
    if found is not None:
        return found
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.is_file() else None


def group_stacks(answers: dict[int, Stacks]) -> list[StackGroup]:
    """Identical (thread name, stack) pairs once, with the ranks that share them; main threads first,
    then by the first rank and the thread's name."""
    shared: dict[tuple[str, bool, str], list[int]] = {}
    for rank in sorted(answers):
        for thread in answers[rank].threads:
            shared.setdefault((thread.name, thread.main, thread.stack), []).append(rank)
    groups = [StackGroup(thread=name, ranks=ranks, stack=stack, main=main)
              for (name, main, stack), ranks in shared.items()]
    return sorted(groups, key=lambda g: (not g.main, g.ranks[0], g.thread))


def _size(result: StacksResult) -> int:
    return len(msgspec.json.encode(result))


def fit(result: StacksResult, budget: int = REPLY_BUDGET) -> StacksResult:
    """`result` under `budget` bytes: stacks and native dumps clipped shorter, then the last groups
    left out; what was cut is said in the note."""
    if _size(result) <= budget:
        return result
    notes = [result.note] if result.note else []
    for limit in CLIPS:
        groups = [msgspec.structs.replace(g, stack=clip_text(g.stack, limit)) for g in result.groups]
        ranks = [msgspec.structs.replace(r, native=None if r.native is None else clip_text(r.native, limit))
                 for r in result.ranks]
        clipped = msgspec.structs.replace(result, groups=groups, ranks=ranks,
                                          note="; ".join([*notes, f"stacks clipped to {limit} characters"]))
        if _size(clipped) <= budget:
            return clipped
    kept = clipped.groups
    while kept and _size(msgspec.structs.replace(clipped, groups=kept)) > budget:
        kept = kept[: len(kept) // 2]
    left = len(clipped.groups) - len(kept)
    return msgspec.structs.replace(clipped, groups=kept, note=f"{clipped.note}; {left} stack group(s) left out")


async def ask(h: RankHandle, wait: float) -> Stacks | None:
    """The rank's answer to one AskStacks, or None when it did not answer within `wait` seconds."""
    request = next(_requests)
    asked = h.asked[request] = StacksAsked()
    try:
        with anyio.move_on_after(wait):
            if await h.channel.send(AskStacks(request=request)):
                await asked.answered.wait()
        return asked.reply
    finally:
        del h.asked[request]


async def py_spy_dump(exe: str, pid: int, native: bool) -> str:
    """py-spy's dump of one process (its threads, native frames with `native`), or why there is none."""
    argv = [exe, "dump", "--pid", str(pid), *(["--native"] if native else [])]
    try:
        with anyio.fail_after(PY_SPY_WAIT):
            done = await anyio.run_process(argv, check=False)
    except TimeoutError:
        return f"py-spy gave no dump within {PY_SPY_WAIT:.0f}s"
    except OSError as exc:
        return f"py-spy could not run: {exc}"
    text = (done.stdout or b"").decode("utf-8", "replace")
    if done.returncode != 0:
        text += (done.stderr or b"").decode("utf-8", "replace") + f"\n(py-spy exited {done.returncode})"
    return clip_text(text, NATIVE_TEXT)


async def _one(h: RankHandle, native: bool, py_spy: str | None, wait: float, limiter: anyio.CapacityLimiter,
               answers: dict[int, Stacks], views: dict[int, RankStacks]) -> None:
    rank = h.rank
    view = RankStacks(rank=rank.rank, state=rank.state.value, pid=h.proc.pid)
    if h.exited.is_set():
        view.note = "exited"
    elif rank.state is RankState.SPAWNED:
        view.note = "not connected yet (no hello)"
    else:
        reply = await ask(h, wait)
        if reply is not None:
            answers[rank.rank] = reply
            view.answered, view.threads, view.omitted = True, len(reply.threads), reply.omitted
        else:
            view.note = (f"no answer within {wait:.0f}s: its reader thread could not run "
                         "(a native call holding the GIL, or a stopped process)")
        if py_spy is not None and (native or reply is None):
            async with limiter:
                view.native = await py_spy_dump(py_spy, h.proc.pid, native)
    views[rank.rank] = view


async def collect(job_id: str, attempt: int, handles: Sequence[RankHandle], *, rank: int | None = None,
                  native: bool = False, wait: float = STACKS_WAIT, py_spy: str | None = None) -> StacksResult:
    """Ask every rank of `handles` (or only `rank`) at once; each answers within `wait` or is said silent."""
    chosen = [h for h in handles if rank is None or h.rank.rank == rank]
    answers: dict[int, Stacks] = {}
    views: dict[int, RankStacks] = {}
    limiter = _limiter()
    async with anyio.create_task_group() as tg:
        for h in chosen:
            tg.start_soon(_one, h, native, py_spy, wait, limiter, answers, views)
    if rank is not None and not chosen:
        views[rank] = RankStacks(rank=rank, state="NOT_STARTED", note="not started in this attempt")
    note = NO_PY_SPY if native and py_spy is None else None
    log.info("job.stacks", job_id=job_id, attempt=attempt, ranks=sorted(views), answered=sorted(answers),
             native=native)
    return fit(StacksResult(job_id=job_id, attempt=attempt, groups=group_stacks(answers),
                            ranks=[views[r] for r in sorted(views)], note=note))
