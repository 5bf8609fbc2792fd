"""The daemon's side of a fork server (``pool_fork_server``; the server: ``worker.forkserver``).

With the fork server on, the pool keeps one interpreter per key, started with ``--fork-server``
as a pooled interpreter is (the key's user, its own cgroup, torch imported), and every pooled
rank is forked from it (`fork_from`) instead of being a whole interpreter of its own: milliseconds
a rank, any number of ranks, and the memory of one interpreter per key. `Spares` keeps workers
forked ahead, as many as the key's last job had ranks, so a job takes them at once.

A request is one `Fork` frame on the server's channel carrying the new worker's channel end
(SCM_RIGHTS); one request at a time per server (`members.ForkServer.lock`), each answered by `Forked`
(the worker's pid) or `ForkRefused` within FORK_WAIT. The server forks through an intermediate
child that exits at once, so the worker is the daemon's child (the daemon is a child subreaper)
by the time `Forked` arrives: `_request` registers it with the reaper of inherited children as the
daemon's own child (`reaper.spawned`, checked under the reaper's lock to be a child of this
process), and wraps it in a `Popen` the attempt waits on, reads the exit status of and signals as
any rank it started itself (`AdoptedChild`). Then the worker's Hello is read on its own channel
within FORK_WAIT. Anything else returns None, and the rank starts cold as with no pool: a server
that refuses, fails or does not answer in time is killed (its answer must never be read by the
next request; the pool starts another), a worker that dies or says something else first is
killed and reaped. The exchange is shielded from cancellation and bounded, for the same reasons.

The forked worker is in the server's cgroup until the attempt takes it (`Launcher._adopt` moves
its pid into the attempt's cgroup before it is assigned; no code of the job has run by then).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping

import anyio
import structlog
from anyio.abc import TaskGroup

from ...protocol import FrameError
from ...protocol.channel import Fork, Forked, ForkRefused, Hello, WorkerMessage
from ..contain import procs
from ..contain.reaper import spawned
from .channel import WorkerChannel
from .members import PoolWorker
from .poolkeys import PoolKey
from .yielding import set_priority

log = structlog.get_logger("ddpd")

FORK_WAIT = 10.0  # seconds for a server's answer, and again for the forked worker's Hello
SPARES_MAX = 64  # forked workers kept ready per key at most


class AdoptedChild(subprocess.Popen[bytes]):
    """A child this process did not start: a forked worker reparented to the daemon (a subreaper).

    Popen's waiting, polling and signalling work on any child's pid; nothing is started here, so
    `Popen.__init__` is not called and the attributes those methods read are set instead. OSError
    when `pid` is not a live child of this process (reparented elsewhere, or gone)."""

    def __init__(self, pid: int) -> None:  # Popen's own would start a process
        info = procs.proc_info(pid)
        if info is None or info.ppid != os.getpid() or info.state == "Z":
            raise OSError(f"pid {pid} is not a live child of the daemon")
        self.args = [f"forked worker {pid}"]
        self.pid = pid
        self.returncode = None
        self.stdin = self.stdout = self.stderr = None
        self.text_mode = False
        self.encoding = self.errors = None
        self.pipesize = -1
        self._child_created = True
        self._waitpid_lock = threading.Lock()
        self._input = None
        self._communication_started = False
        self._sigint_wait_secs = 0.25
        self._closed_child_pipe_fds = True


async def fork_from(server: PoolWorker, spare: bool = False) -> PoolWorker | None:
    """One worker forked by `server` (a ready fork server of its key), now the caller's, with its
    Hello read; None when the server refused or failed (the caller starts the rank cold; a server
    that failed is killed, and the pool starts another). Shielded and bounded (twice FORK_WAIT): a
    request cut short would leave its answer unread for the next one, and a forked worker nobody
    waits for."""
    assert server.server is not None
    started = time.monotonic()
    with anyio.CancelScope(shield=True):
        async with server.server.lock:
            got = await _request(server)
        if got is None:
            kill(server.pid)  # its watcher reaps it; the pool starts another
            return None
        child, channel = got
        hello = await _next_frame(channel)
        if not isinstance(hello, Hello) or hello.pid != child.pid:
            channel.close()
            kill(child.pid)
            await procs.wait_exit(child)
            log.warning("pool.fork_failed", server=server.pid, pid=child.pid, first_frame=type(hello).__name__)
            return None
        server.server.forks += 1
        log.info("pool.forked", server=server.pid, pid=child.pid, ms=round(1000 * (time.monotonic() - started), 1),
                 forks=server.server.forks, uid=server.key.uid, spare=spare)
        set_priority(child.pid, idle=False)  # a server started beside a job may be at idle priority
        return PoolWorker(child, channel, server.key, server.env, hello=hello, taken=True)
    return None  # (not reached: a shielded scope is never cancelled)


async def _request(server: PoolWorker) -> tuple[AdoptedChild, WorkerChannel] | None:
    """Send one `Fork` and adopt what the server forked (the worker's channel comes with it)."""
    parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sent = await server.channel.send(Fork(), fds=[child_end.fileno()])
    finally:
        child_end.close()
    answer = await _next_frame(server.channel) if sent else None
    if not isinstance(answer, Forked):
        parent_end.close()
        why = answer.reason if isinstance(answer, ForkRefused) else f"answer {type(answer).__name__}"
        log.warning("pool.fork_refused", server=server.pid, reason=why)
        return None
    try:
        child = spawned(lambda: AdoptedChild(answer.pid))
    except OSError as exc:
        parent_end.close()
        log.warning("pool.fork_failed", server=server.pid, pid=answer.pid, error=str(exc))
        return None
    return child, WorkerChannel(parent_end)


async def _next_frame(channel: WorkerChannel) -> WorkerMessage | None:
    """The channel's next frame within FORK_WAIT; None at its end, a bad frame or the deadline."""
    with anyio.move_on_after(FORK_WAIT):
        try:
            async for frame in channel.frames():
                return frame
        except FrameError:
            return None
    return None


def kill(pid: int) -> None:
    """SIGKILL a server or a forked worker and its process group (each leads its own)."""
    procs.kill_group(pid, signal.SIGKILL)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class Plans:
    """The pool's plans (`WarmPool._fill`) by number, for a key's first job: its `use` asks for the
    first plan to start after it (`ask`: the one under way may have computed its spawns before the
    key was known), and its ranks `wait` until that plan is done; the key's server is starting
    then, or none is coming (the user's share, a backoff)."""

    def __init__(self) -> None:
        self._started = 0
        self._done = 0
        self._event = anyio.Event()
        self._asked: dict[PoolKey, int] = {}

    def ask(self, key: PoolKey) -> None:
        self._asked[key] = self._started + 1

    def forget(self, key: PoolKey) -> None:
        self._asked.pop(key, None)

    def begin(self) -> None:
        self._started += 1

    def end(self) -> None:
        self._done = self._started
        self._event.set()
        self._event = anyio.Event()

    def pending(self, key: PoolKey) -> bool:
        """Whether the plan `key` asked for is not done yet."""
        return self._done < self._asked.get(key, 0)

    async def wait(self, key: PoolKey) -> None:
        """Until the plan `key` asked for is done (the caller bounds it: a stopping pool plans no more)."""
        while self.pending(key):
            await self._event.wait()


class Spares:
    """Forked workers kept ready per key (``pool_fork_server``): a job's ranks take them at once, and
    the key's server forks the next ones in the background, in milliseconds each (no refill imports
    torch). Each key keeps as many as its last job had ranks (at most SPARES_MAX): they share their
    server's memory, copy on write. A spare lives in its server's cgroup until taken (killed with it,
    the server's end kills the cgroup), is watched through its pidfd (reaped and dropped if it dies),
    and is killed when its key is forgotten or the pool stops."""

    def __init__(self) -> None:
        self._ready: dict[PoolKey, deque[PoolWorker]] = {}
        self._filling: set[PoolKey] = set()

    def count(self, key: PoolKey | None = None) -> int:
        if key is not None:
            return len(self._ready.get(key, ()))
        return sum(len(q) for q in self._ready.values())

    def pids(self, key: PoolKey) -> tuple[int, ...]:
        """The pids of the spares of `key` ready now."""
        return tuple(w.pid for w in self._ready.get(key, ()))

    def take(self, key: PoolKey) -> PoolWorker | None:
        """A spare of `key`, now the caller's; None when none is ready."""
        ready = self._ready.get(key)
        while ready:
            w = ready.popleft()
            w.taken = True
            w.scope.cancel()  # its watcher lets go of it
            if w.proc.poll() is None:
                log.info("pool.worker_taken", pid=w.pid, ready=len(ready), uid=key.uid, spare=True)
                return w
        return None

    async def sync(self, tg: TaskGroup, servers: Mapping[PoolKey, Iterable[PoolWorker]],
                   ranks: Mapping[PoolKey, int]) -> None:
        """Each key's spares back to its last job's `ranks` (forked by its ready server); those of
        keys no longer wanted end."""
        await self.drop(keep=lambda key: key in ranks)
        for key, ready in servers.items():
            server = next(iter(ready), None)
            if server is not None and key in ranks:
                self.fill(tg, server, ranks[key])

    def fill(self, tg: TaskGroup, server: PoolWorker, want: int) -> None:
        """Fork spares of the server's key up to `want` (one filler per key at a time)."""
        if server.key not in self._filling and self.count(server.key) < min(want, SPARES_MAX):
            self._filling.add(server.key)
            tg.start_soon(self._fill, tg, server, min(want, SPARES_MAX))

    async def _fill(self, tg: TaskGroup, server: PoolWorker, want: int) -> None:
        try:
            while self.count(server.key) < want and server.proc.returncode is None:
                w = await fork_from(server, spare=True)
                if w is None:
                    return
                w.taken = False
                self._ready.setdefault(server.key, deque()).append(w)
                tg.start_soon(self._watch, w)
        finally:
            self._filling.discard(server.key)

    async def _watch(self, w: PoolWorker) -> None:
        with w.scope:
            await procs.wait_exit(w.proc)
            log.info("pool.spare_ended", pid=w.pid, uid=w.key.uid)
        if w.taken:  # the attempt's from now on
            return
        ready = self._ready.get(w.key)
        if ready is not None and w in ready:
            ready.remove(w)
        if w.proc.returncode is not None:
            w.channel.close()

    async def drop(self, keep: Callable[[PoolKey], bool] = lambda key: False) -> None:
        """Kill and reap the spares of every key not to `keep` (all by default)."""
        for key in [k for k in self._ready if not keep(k)]:
            for w in self._ready.pop(key):
                w.scope.cancel()
                w.channel.close()
                kill(w.pid)
                with anyio.CancelScope(shield=True), anyio.move_on_after(FORK_WAIT):
                    await procs.wait_exit(w.proc)
