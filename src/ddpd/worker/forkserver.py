"""The fork server: one interpreter per pool key that has imported what a rank needs and forks
pooled workers on the daemon's request (``--fork-server``, docs/pool.md).

The server is started as a pooled interpreter is (as the key's user, in a cgroup of its own, with
torch and the DDP machinery imported: `bootstrap.pool_imports`), says Hello, and from then on only
reads `Fork` frames on its main thread. It never touches CUDA, never runs a job's code, never
becomes a rank, and starts no thread: a fork copies only the forking thread, so a lock another
thread held would stay locked in the child for good. Before each fork it counts its threads
(``/proc/self/task``) and refuses (`ForkRefused`, with the count) where it is not alone.

Each `Fork` carries the new worker's channel end (SCM_RIGHTS). The server forks twice
(`fork_worker`): the intermediate child forks the worker and exits at once, the server reaps the
intermediate and answers `Forked` with the worker's pid. The worker, orphaned, is reparented to the
daemon (a child subreaper), which reaps it and reads its exit status as it does a rank's it started
itself. In the worker (`become_worker`), before anything else: the server's channel is closed, a
session and process group of its own (``setsid``, as every rank leads one), the intermediate's exit
awaited (its pidfd), then PR_SET_PDEATHSIG set against its new parent, the daemon (set while the
intermediate was its parent, it would have fired at the intermediate's exit; a fork clears it), and
its parent checked to be the daemon (else it exits EXIT_ORPHANED, as a worker started by a parent
that is gone). The main thread's `native_id` becomes the worker's own (`own_native_id`). Then the
state a fresh interpreter would not share with its siblings is seeded afresh (`reseed`): torch's
default generator (a fresh interpreter seeds it from the system's entropy at import), numpy's legacy
global generator where numpy is imported (seeded at its import; never at a fork), Python's `random`
(CPython reseeds it at every fork itself). The worker then goes on as a pooled interpreter does: its
own threads, Hello on its own channel, then its Assign.
"""

from __future__ import annotations

import os
import select
import socket
import sys
import threading
from typing import NoReturn

from ddpd.protocol.channel import Fork, Forked, ForkRefused, Hello
from ddpd.protocol.worker import EXIT_ORPHANED

from .runtime import Channel

EXIT_FORK_FAILED = 72  # the intermediate child: the worker's fork failed
REPARENT_WAIT_MS = 10_000  # the intermediate exits at once; this only bounds a parent that is not it


def pooled_argv(argv: list[str], fd: int) -> list[str]:
    """The server's command line (`sys.argv`, `sys.orig_argv`) as a forked worker's: its own channel's
    ``--fd``, and no ``--fork-server``: what a whole pooled interpreter's says (a cold rank's, with
    ``--pool``), so a task that reads its channel from ``--fd`` finds it."""
    out: list[str] = []
    words = iter(argv)
    for word in words:
        if word == "--fork-server":
            continue
        out.append(word)
        if word == "--fd" and next(words, None) is not None:
            out.append(str(fd))
    return out


def thread_count() -> int:
    """Threads of this process now (a fork copies only the calling one)."""
    return len(os.listdir("/proc/self/task"))


def serve_forks(sock: socket.socket, parent: int, daemon_pgid: int, hello: Hello) -> int:
    """The server's loop: say `hello`, then fork a worker for each `Fork` until the channel closes
    (then exit). Returns only in a forked worker: the descriptor of its own channel."""
    channel = Channel(sock, daemon_pgid)
    channel.send(hello)
    for message in channel.frames():
        if not isinstance(message, Fork):
            print(f"ddpd fork server: ignoring {type(message).__name__}", file=sys.stderr, flush=True)
            continue
        if not channel.fds:
            channel.send(ForkRefused(reason="no channel came with the request"))
            continue
        fd = channel.fds.pop(0)
        threads = thread_count()
        if threads != 1:  # never fork beside another thread (see the module docstring)
            os.close(fd)
            channel.send(ForkRefused(reason=f"the fork server has {threads} threads; it forks only alone"))
            continue
        try:
            pid = fork_worker()
        except OSError as exc:
            os.close(fd)
            channel.send(ForkRefused(reason=f"fork failed: {exc}"))
            continue
        if pid == 0:  # the worker
            for passed in channel.fds:
                os.close(passed)
            sock.close()
            become_worker(parent)
            return fd
        os.close(fd)
        channel.send(Forked(pid=pid))
    os._exit(0)  # the daemon closed the channel: nothing to serve


def fork_worker() -> int:
    """Fork a worker through an intermediate child that exits at once: its pid here, 0 in the worker.
    OSError when either fork fails (nothing is left then)."""
    read_end, write_end = os.pipe()
    try:
        middle = os.fork()
    except OSError:
        os.close(read_end)
        os.close(write_end)
        raise
    if middle == 0:
        os.close(read_end)
        _intermediate(write_end)  # returns in the worker only
        return 0
    os.close(write_end)
    try:
        data = b""
        while chunk := os.read(read_end, 8):
            data += chunk
    finally:
        os.close(read_end)
    _, status = os.waitpid(middle, 0)  # once it is reaped, the worker is the daemon's child
    if os.waitstatus_to_exitcode(status) != 0 or len(data) != 4:
        raise OSError(f"the intermediate child ended with status {status} before the worker started")
    return int.from_bytes(data, "little")


def _intermediate(write_end: int) -> None:
    """The intermediate child: fork the worker, tell the server its pid, exit. Returns in the worker."""
    try:
        pid = os.fork()
    except OSError:
        os._exit(EXIT_FORK_FAILED)
    if pid == 0:
        os.close(write_end)
        return
    os.write(write_end, pid.to_bytes(4, "little"))
    os._exit(0)


def become_worker(parent: int) -> None:
    """In the forked worker: a session of its own, the daemon as its parent (its death signal
    against it), fresh random state (see the module docstring)."""
    os.setsid()
    own_native_id()
    _await_reparent(parent)
    from .bootstrap import set_pdeathsig

    set_pdeathsig()
    if os.getppid() != parent:  # the daemon is gone (or is no subreaper): nobody would reap this
        _orphaned()
    reseed()


def own_native_id() -> None:
    """The main thread's `native_id` made this process's own: CPython 3.11 leaves the forking
    process's there after a fork (``threading._after_fork`` updates the ident only), where a fresh
    interpreter has its own pid."""
    main = threading.main_thread()
    if main.native_id != threading.get_native_id():
        main._set_native_id()  # type: ignore[attr-defined]


def _await_reparent(parent: int) -> None:
    """Wait until the intermediate child has exited (the worker is then reparented to the daemon)."""
    middle = os.getppid()
    if middle == parent:  # reparented already (waiting on the daemon's pidfd would never end)
        return
    try:
        fd = os.pidfd_open(middle)
    except ProcessLookupError:
        return
    try:
        if os.getppid() != middle:  # it exited before the pidfd was opened (its pid may be reused)
            return
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        poller.poll(REPARENT_WAIT_MS)  # bounded: past it, the parent check that follows decides
    finally:
        os.close(fd)


def _orphaned() -> NoReturn:
    os._exit(EXIT_ORPHANED)


def reseed() -> None:
    """Seed afresh what a fresh interpreter seeds at start and a fork copies: torch's default
    generator and numpy's legacy global one (Python's `random` is reseeded by CPython at fork)."""
    import torch

    torch.default_generator.seed()  # the CPU one only, as the import does (CUDA's are seeded when CUDA starts)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
