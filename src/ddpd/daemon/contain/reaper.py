"""The daemon's own children, and the reaper of every other child it inherits.

The daemon is a child subreaper (PR_SET_CHILD_SUBREAPER): a descendant whose parent dies (a job's
orphaned grandchildren, a `setsid` escapee) becomes its child, and that child's zombie stays until
the daemon reaps it. The daemon's own children (ranks, pool workers, the gate, interpreter checks)
are reaped by their owners (`Popen.wait`, pidfd waits): reaping one of those here would steal its
exit status (the owner's wait gets ECHILD and CPython reports exit code 0). So:

- every child the daemon starts and waits for is started through `spawned`: under one lock, the
  fork and the registration of its pid (with its start time, so a reused pid is not mistaken for
  it) happen together;
- `reap_inherited` (on every SIGCHLD, and once at start: `reap_forever`) takes the same lock, lists
  the daemon's children (`/proc/self/task/*/children`, else a scan of /proc) and reaps those that
  are zombies, not registered, and not in the daemon's own process group (helpers it runs through
  `subprocess.run` or `anyio.run_process` stay in that group and are waited for by their callers);
  registrations whose pid is no longer a child of the same start time (its owner reaped it) are
  dropped; an owner that stops waiting (an unkillable rank's attempt gives up) `disown`s its child.

`spawned` and `reap_inherited` block briefly (a fork, a few /proc reads); `reap_forever` runs the
reaping in a worker thread.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

import anyio
import anyio.to_thread
import structlog
from anyio.streams.memory import MemoryObjectSendStream

log = structlog.get_logger("ddpd")

P = TypeVar("P", bound="subprocess.Popen[bytes]")

_lock = threading.Lock()
_known: dict[int, int] = {}  # pid -> start time (clock ticks since boot) of the children owners wait for


def _stat(pid: int) -> tuple[str, int, int, int] | None:
    """State, parent, process group and start time of `pid` from /proc (None: gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            raw = f.read()
    except OSError:
        return None
    rest = raw[raw.rindex(")") + 2 :].split()  # the command name may hold spaces and parentheses
    return rest[0], int(rest[1]), int(rest[2]), int(rest[19])


def spawned(start: Callable[[], P]) -> P:
    """Run `start` (a Popen) and register its child as one whose owner reaps it (see the module)."""
    with _lock:
        proc = start()
        info = _stat(proc.pid)
        _known[proc.pid] = -1 if info is None else info[3]
        return proc


def disown(pid: int) -> None:
    """Hand a registered child to the reaper of inherited children: its owner waits no more (an
    unkillable rank its attempt gave up on), so whenever it dies, its zombie is reaped here."""
    with _lock:
        _known.pop(pid, None)


def children() -> set[int]:
    """The pids whose parent is this process (any of its threads)."""
    me = os.getpid()
    found: set[int] = set()
    try:
        for tid in os.listdir(f"/proc/{me}/task"):
            with open(f"/proc/{me}/task/{tid}/children") as f:
                found.update(int(p) for p in f.read().split())
    except FileNotFoundError:  # a kernel without CONFIG_PROC_CHILDREN (or a thread gone): scan
        found = set()
        for name in os.listdir("/proc"):
            info = _stat(int(name)) if name.isdigit() else None
            if info is not None and info[1] == me:
                found.add(int(name))
    return found


def _inherited_zombie(pid: int, own_group: int) -> bool:
    if pid in _known:  # alive with its start time, checked just before under the same lock
        return False
    info = _stat(pid)
    return info is not None and info[0] == "Z" and info[2] != own_group


def reap_inherited() -> list[int]:
    """Reap every zombie child that no owner waits for (blocking: call via anyio.to_thread)."""
    own_group, me = os.getpgid(0), os.getpid()
    reaped: list[int] = []
    with _lock:
        for pid, start in list(_known.items()):  # by /proc, not by the listing (a thread's exit moves its children)
            info = _stat(pid)
            if info is None or info[1] != me or info[3] != start:
                del _known[pid]
        for pid in children():
            if not _inherited_zombie(pid, own_group):
                continue
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:  # reaped meanwhile (a sweep of its attempt)
                continue
            if done == pid:
                reaped.append(pid)
    return reaped


async def reap_forever() -> None:
    """Reap inherited zombies at start and after SIGCHLD, until cancelled. Signals that arrive during
    a pass ask for one more pass, not one each (a job's hundred orphans dying at once)."""
    send, receive = anyio.create_memory_object_stream[None](1)
    with anyio.open_signal_receiver(signal.SIGCHLD) as signals, send, receive:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_ask, signals, send)
            await _reap()
            async for _ in receive:
                await _reap()


async def _ask(signals: AsyncIterator[int], send: MemoryObjectSendStream[None]) -> None:
    async for _ in signals:
        with contextlib.suppress(anyio.WouldBlock):  # a pass is asked for already
            send.send_nowait(None)


async def _reap() -> None:
    reaped = await anyio.to_thread.run_sync(reap_inherited)
    if reaped:
        log.debug("reaper.reaped", count=len(reaped), pids=reaped[:20])
