"""The warm pool: fresh worker interpreters that have already imported torch, waiting for a rank.

A cold rank pays for ``import torch`` and the modules DDP imports lazily (about 2-3 s); a pooled
one has done that before the job was submitted. The pool is one service in the daemon's root
task group:

- **Spawning**: ``<worker> --fd N --parent <daemon pid> --pool`` (``protocol.worker``) through ``procs.spawn``, always
  from the event-loop thread (the worker's PR_SET_PDEATHSIG fires when the parent *thread* exits,
  so never from ``anyio.to_thread``), never forked from the daemon. Each pool worker leads its own
  new process group (``process_group=0``), so an idle one is never hit by an attempt's group
  signals. Its stdout/stderr go to ``<state_dir>/pool.log`` until it is assigned; then it appends
  them to its rank log (``Assign.log_path``). Its environment is the daemon's, less the systemd
  variables, with ``PYTHONUNBUFFERED=1``: the same base a cold rank's environment is built on, so
  ``Assign.env`` (the difference to the daemon's environment) completes it exactly.
- **Readiness**: the worker's Hello (its CONNECTED) is read here; then the worker is ready and
  the pool watches only its pidfd. A pool worker sends nothing between Hello and Assign, so the
  channel is handed over with nothing unread.
- **Death while idle**: the pidfd wakes the watcher; the worker is reaped, logged
  (``pool.worker_died``) and replaced. Workers that die before their Hello back off
  exponentially (1 s doubling to 60 s) so a broken interpreter cannot spawn in a loop.
- **take()**: hands out a ready worker (its Popen, WorkerChannel and Hello) and stops watching it;
  the attempt owns it from then on: one rank of one job, never returned. None when no worker is
  ready (the rank starts cold). Every take wakes the refill, which spawns in the background
  (a task of the pool, not of the attempt). No polling: only pidfds, sockets and events.
- **Shutdown**: every pool worker left is SIGKILLed (with its group) and reaped, and its channel
  closed (which alone would make an idle worker exit too).

Which jobs may use the pool: see `pool_eligible`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio
import structlog
from anyio.abc import TaskGroup, TaskStatus

from ..protocol import FrameError, JobSpec
from ..protocol.channel import Hello, WorkerMessage
from ..protocol.worker import worker_args
from . import procs
from .channel import WorkerChannel
from .config import Config

log = structlog.get_logger("ddpd")

# Variables read when the interpreter, libc, the OpenMP/BLAS runtimes or torch (and the modules a
# pool worker pre-imports, e.g. torch._dynamo's config) start: a warm interpreter has already read
# them, so a job whose spec.env sets one of them runs cold. Not in the list, so fine on the pool:
# CUDA_* (CUDA is initialised lazily, after the assignment), NCCL_* and GLOO_* (read when a
# communicator is created), OMP_NUM_THREADS (applied with torch.set_num_threads), MASTER_*, RANK...
COLD_ENV_PREFIXES = (
    "PYTHON", "LD_", "MALLOC_", "GLIBC_", "TORCH", "PYTORCH_", "OMP_", "GOMP_", "KMP_", "MKL_",
    "OPENBLAS_", "LC_", "LANG",
)
POOL_SAFE_ENV = frozenset({"OMP_NUM_THREADS"})
SYSTEMD_ENV = ("NOTIFY_SOCKET", "LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES", "WATCHDOG_USEC", "WATCHDOG_PID")
BACKOFF_MAX = 60.0
SHUTDOWN_WAIT = 5.0


def pool_eligible(spec: JobSpec) -> str | None:
    """None when the job's ranks may be pooled workers, else why they must start cold."""
    for key in spec.env:
        if key not in POOL_SAFE_ENV and key.startswith(COLD_ENV_PREFIXES):
            return f"spec.env sets {key}, read at interpreter or torch start"
    return None


def pool_env() -> dict[str, str]:
    env = dict(os.environ)
    for key in SYSTEMD_ENV:
        env.pop(key, None)
    env["PYTHONUNBUFFERED"] = "1"
    # torch must not size its intra-op pool to every core before the rank's count is known: started
    # with the default, a pooled rank trained 2x slower after set_num_threads(1) than a cold one; from 1
    # the rank raises it on Assign (OMP_NUM_THREADS in Assign.env) without that cost
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


@dataclass(eq=False)
class PoolWorker:
    proc: subprocess.Popen[bytes]
    channel: WorkerChannel
    spawned_at: float = field(default_factory=time.monotonic)
    hello: Hello | None = None
    taken: bool = False
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)

    @property
    def pid(self) -> int:
        return self.proc.pid


class WarmPool:
    def __init__(self, config: Config, busy_ranks: Callable[[], int] = lambda: 0) -> None:
        self.config = config
        self.size = max(0, config.pool_size)
        self.log_path = config.state_dir / "pool.log"
        self._ready: deque[PoolWorker] = deque()
        self._starting: set[PoolWorker] = set()
        self._workers: set[PoolWorker] = set()  # every untaken worker not yet reaped
        self._wake = anyio.Event()
        self._failures = 0  # consecutive deaths before hello
        self._closing = False
        self._cores = len(os.sched_getaffinity(0))
        self.busy_ranks = busy_ranks  # CPU-busy ranks of running jobs

    def poke(self) -> None:
        """Something freed cores (a job ended): refill if the pool is short."""
        self._wake.set()

    def _idle_core(self) -> bool:
        """Refill only onto idle cores: importing torch (seconds of CPU) must not slow a running job."""
        return self.busy_ranks() + len(self._starting) < self._cores

    # -- for attempts ----------------------------------------------------------------------

    @property
    def ready_pids(self) -> list[int]:
        return [w.pid for w in self._ready]

    def take(self) -> tuple[subprocess.Popen[bytes], WorkerChannel, Hello] | None:
        """A ready worker, now the caller's (it leads its own process group); None: start cold."""
        while self._ready:
            w = self._ready.popleft()
            w.taken = True
            self._workers.discard(w)
            w.scope.cancel()  # the watcher lets go of it (its pidfd wait ends at the next checkpoint)
            self._wake.set()
            if w.proc.poll() is not None:  # died a moment ago, before its watcher ran
                log.warning("pool.worker_died", pid=w.pid, exit=str(procs.Exit.from_returncode(w.proc.returncode)),
                            idle=True)
                w.channel.close()
                continue
            assert w.hello is not None
            log.info("pool.worker_taken", pid=w.pid, ready=len(self._ready), size=self.size)
            return w.proc, w.channel, w.hello
        return None

    # -- the service -----------------------------------------------------------------------

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Keep `size` workers ready or starting until cancelled; then kill and reap them all."""
        if self.size == 0:
            task_status.started()
            return
        try:
            async with anyio.create_task_group() as tg:
                task_status.started()
                log.info("pool.started", size=self.size, log=str(self.log_path))
                while True:
                    await self._fill(tg)
                    await self._wake.wait()
                    self._wake = anyio.Event()
        finally:
            with anyio.CancelScope(shield=True):
                await self._close()

    async def _fill(self, tg: TaskGroup) -> None:
        if self._failures:
            delay = min(BACKOFF_MAX, 2.0 ** (self._failures - 1))
            log.warning("pool.backoff", seconds=delay, failures=self._failures)
            await anyio.sleep(delay)
        while not self._closing and len(self._ready) + len(self._starting) < self.size and self._idle_core():
            w = self._spawn()
            if w is None:
                self._failures += 1
                self._wake.set()  # try again after the backoff
                return
            self._starting.add(w)
            self._workers.add(w)
            tg.start_soon(self._watch, w)
            await anyio.lowlevel.checkpoint()  # let a waiting attempt run between spawns

    def _spawn(self) -> PoolWorker | None:
        """Start one pool worker (from the event-loop thread: see the module docstring)."""
        parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        argv = [*(self.config.worker_command or (sys.executable, "-m", "ddpd.worker")),
                *worker_args(child_end.fileno(), os.getpid(), pool=True)]
        try:
            log_fd = procs.open_log(self.log_path)
            try:
                proc = procs.spawn(argv, env=pool_env(), cwd=str(self.config.state_dir), log_fd=log_fd,
                                   pass_fds=[child_end.fileno()], process_group=0)
            finally:
                os.close(log_fd)
        except OSError as exc:
            parent_end.close()
            log.error("pool.spawn_failed", error=str(exc))
            return None
        finally:
            child_end.close()
        log.info("pool.worker_spawned", pid=proc.pid)
        return PoolWorker(proc, WorkerChannel(parent_end))

    async def _watch(self, w: PoolWorker) -> None:
        """Read the worker's Hello, then wait on its pidfd until it dies or is taken."""
        with w.scope:
            try:
                hello: WorkerMessage | None = None
                try:
                    async for first in w.channel.frames():
                        hello = first
                        break  # only the first frame: the rest of the channel is the attempt's
                except FrameError:
                    hello = None
                self._starting.discard(w)
                if not isinstance(hello, Hello) or hello.pid != w.pid:
                    self._failures += 1
                    self._kill(w)
                    exit_ = await procs.wait_exit(w.proc)
                    log.error("pool.worker_failed", pid=w.pid, exit=str(exit_), log=str(self.log_path),
                              first_frame=type(hello).__name__)
                    return
                self._failures = 0
                w.hello = hello
                self._ready.append(w)
                self._wake.set()  # its core is free again: the next one may start
                log.info("pool.worker_ready", pid=w.pid, seconds=round(time.monotonic() - w.spawned_at, 3),
                         ready=len(self._ready), size=self.size)
                exit_ = await procs.wait_exit(w.proc)
                log.warning("pool.worker_died", pid=w.pid, exit=str(exit_), idle=True)
            finally:
                self._starting.discard(w)
                if w in self._ready:
                    self._ready.remove(w)
                if w.proc.returncode is not None:  # reaped; else (shutdown) `_close` kills it
                    self._workers.discard(w)
                    w.channel.close()
                if not w.taken:
                    self._wake.set()

    def _kill(self, w: PoolWorker) -> None:
        if w.proc.returncode is None:  # not reaped yet: the pid is still ours
            procs.kill_group(w.pid, signal.SIGKILL)  # it leads its own group until assigned
            try:
                os.kill(w.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    async def _close(self) -> None:
        self._closing = True
        left = list(self._workers)
        self._ready.clear()
        for w in left:
            w.channel.close()
            self._kill(w)
        with anyio.move_on_after(SHUTDOWN_WAIT):
            for w in left:
                await procs.wait_exit(w.proc)
        alive = [w.pid for w in left if w.proc.poll() is None]
        log.info("pool.stopped", killed=[w.pid for w in left], unkillable=alive)
