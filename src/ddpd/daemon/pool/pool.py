"""The warm pool: fresh worker interpreters that have already imported torch, waiting for a rank.

A cold rank pays for ``import torch`` and the modules DDP imports lazily (about 2-3 s); a pooled
one has done that before the job was submitted. The pool keeps interpreters per `PoolKey` (user,
interpreter, start-up environment; see `poolkeys`), learned from the jobs that ran (`use`), and
sized by `poolkeys.plan` (``pool_size`` in all, ``pool_per_key`` per key, idle keys forgotten
after ``pool_idle_expiry``). It is one service in the daemon's root task group:

- **Spawning**: ``<interpreter> -m ddpd.worker --fd N --parent <daemon pid> --pool``
  (``protocol.worker``) through ``procs.spawn``, always from the event-loop thread (the worker's
  PR_SET_PDEATHSIG fires when the parent *thread* exits, so never from ``anyio.to_thread``), never
  forked from the daemon. As a cold rank of that key would be: as the key's user (through the
  gate, umask 0077), with that interpreter and the key's start-up environment (`start_env`), and,
  where the daemon has a cgroup subtree, inside a cgroup of its own (``jobs/pool-<n>``) before
  any code of the user's interpreter runs. Each pool worker leads a new session and process group
  (as every rank does, and keeps when taken), so an idle one is never hit by an attempt's signals. Its
  stdout/stderr go to ``pool.log`` (the daemon's, or the user's in their tree) until it is
  assigned; then it appends them to its rank log (``Assign.log_path``).
- **Readiness**: the worker's Hello (its CONNECTED) is read here, or its exit seen, whichever comes
  first (what a user's wrapper left may hold the channel open); then it is ready and the pool
  watches only its pidfd (it sends nothing before Assign: the channel is handed over unread).
- **A start deadline**: a member not ready within ``pool_start_timeout`` seconds (a user's wrapper
  or sitecustomize that stalls, never runs python, or waits on something that never comes) is
  killed with its cgroup and counted as a failure (`pool.worker_failed`, ``reason``), its key backed
  off. A refill yields to jobs by design (held, or at idle priority), so the count restarts while,
  and from when, jobs hold cores.
- **Death while idle**: the pidfd wakes the watcher; the worker is reaped, its cgroup killed and
  removed (a wrapper's `setsid` escapee with it), logged (``pool.worker_died``) and replaced. A key
  whose workers die before their Hello backs off exponentially (1 s doubling to 60 s), so a broken
  interpreter cannot spawn in a loop; other keys are not held up. A forgotten key's members end,
  ready or still starting (one that never says Hello too).
- **take(key)**: hands out a ready worker of that key only and stops watching it; the attempt
  owns it from then on (it moves the worker's cgroup into the attempt's): one rank of one job,
  never returned. None when none is ready (the rank starts cold). A job's `use` claims its ranks
  until its takes: a start that lowers its key's want never has the refill loop retire the ready
  interpreters it is about to take (it did: a 1-rank job after a 2-rank one started cold). Every
  take wakes the refill, which spawns in the background. No polling: only pidfds, sockets,
  events and the next expiry's deadline.
- **Priority** (`yielding`; the interpreters' refills import torch, a fork server's are forks): a
  refill never slows a running job. Refills start only onto cores no running job's ranks hold (a
  refill at SCHED_IDLE beside a latency-bound job still cost it a fifth of its steps/s). Where the
  daemon may set a thread's policy both ways (`can_idle`: a root daemon), a refill under way when a
  job starts goes to SCHED_IDLE (every thread; later ones inherit it) while jobs hold cores, and
  back to normal priority the moment none runs (each job's start and end wake the pool); a pool
  cgroup with the cpu controller gets ``cpu.idle`` 1 meanwhile. Where pool workers have cgroups, a
  refill under way beyond the cores the running jobs' ranks leave free is held, its cgroup frozen
  (``cgroup.freeze``), until a core is free again (a refill at SCHED_IDLE still cost back-to-back
  jobs several percent of their steps/s). `take` gives every thread normal priority back before
  the attempt assigns it. `state` says which (``ddpctl daemon``).
- **Fork servers** (``pool_fork_server``, `forkserver`): one interpreter per key (``pool_size``
  counts them, the plan's bounds apply) forks workers; `take` hands out a spare it forked ahead
  (`Spares`: as many as the key's last job had ranks) or has it fork one (milliseconds). A job of a
  key whose server is starting (its first job, most often) waits for it (`_server`, bounded by
  ``pool_server_wait``) rather than start cold beside it; a server's start is never held.
- **Shutdown**: every pool worker left is SIGKILLed (group, cgroup), reaped, its channel closed.
"""

from __future__ import annotations

import itertools
import os
import socket
import time
from collections import Counter, deque
from collections.abc import Callable

import anyio
import anyio.to_thread
import structlog
from anyio.abc import TaskGroup, TaskStatus

from ...protocol.channel import Hello, WorkerMessage
from ...protocol.worker import worker_args
from ..config import Config
from ..contain import procs
from ..contain.cgroups import Cgroup, Subtree
from ..contain.usertree import create_user_file
from ..layout import POOL_LOG
from .channel import WorkerChannel
from .forkserver import Plans, Spares, fork_from, kill
from .members import POOL, ForkServer, ServerSnapshot
from .members import PoolWorker as PoolWorker  # (where the attempt imports them from)
from .poolkeys import Claims, Demand, PoolKey, Shape, next_expiry, plan
from .yielding import can_idle, freeze_cgroup, idle_cgroup, pool_state, set_priority

log = structlog.get_logger("ddpd")

BACKOFF_MAX = 60.0
SHUTDOWN_WAIT = 5.0
MAX_KEYS = 256  # keys remembered at once (each is a few hundred bytes; the plan serves the recent ones)


class WarmPool:
    def __init__(self, config: Config, busy_ranks: Callable[[], int] = lambda: 0,
                 subtree: Subtree | None = None) -> None:
        self.config = config
        self.size = max(0, config.pool_size)
        self.fork = config.pool_fork_server  # one fork server per key instead of whole interpreters
        self.per_key = min(1, config.pool_per_key) if self.fork else max(0, config.pool_per_key)
        self.spares = Spares()  # forked workers ready, per key (fork servers only)
        self.idle_expiry = config.pool_idle_expiry
        self.subtree = subtree  # pool workers get cgroups of their own under subtree.jobs
        self.log_path = config.state_dir / POOL_LOG
        self._demand: dict[PoolKey, Demand] = {}
        self._ready: dict[PoolKey, deque[PoolWorker]] = {}
        self._starting: set[PoolWorker] = set()
        self._workers: set[PoolWorker] = set()  # every untaken worker not yet reaped
        self._wake = anyio.Event()
        self._failures: dict[PoolKey, int] = {}  # consecutive deaths before hello, per key
        self._retry_at: dict[PoolKey, float] = {}
        self._claims = Claims()  # ranks a starting job will take, per key: no surplus to retire
        self._closing = False
        self._cores = len(os.sched_getaffinity(0))
        self._names = itertools.count()
        self.busy_ranks = busy_ranks  # CPU-busy ranks of running jobs
        self.idle_priority = can_idle()  # refills at SCHED_IDLE beside jobs (else: onto idle cores only)
        self.start_timeout = config.pool_start_timeout
        self.server_wait = config.pool_server_wait  # from its spawn, a starting server may hold a job's ranks
        self._busy_at = -float("inf")  # when jobs last held cores, as `_yield_to_jobs` saw it
        self._was_busy = False
        self._plans = Plans()  # what a key's first job waits for before its server is starting

    @property
    def contained(self) -> bool:
        """Pool workers live in cgroups of their own (an attempt without a cgroup must start cold)."""
        return self.subtree is not None

    def poke(self) -> None:
        """Something freed cores (a job ended): refill if the pool is short."""
        self._wake.set()

    def _idle_core(self) -> bool:
        """Whether a refill may start now: only onto a core no running job's rank holds."""
        return self.busy_ranks() + len(self._starting) < self._cores

    def state(self) -> str:
        """The pool in words, for ``ddpctl daemon``: warm, refilling, or cold and why."""
        return pool_state(self.size, len(self.ready_pids), len(self._starting), self.busy_ranks() > 0,
                          self.idle_priority, held=sum(w.held for w in self._starting), servers=self.fork,
                          forks=sum(w.server.forks for q in self._ready.values() for w in q if w.server),
                          spares=self.spares.count())

    def servers(self) -> list[ServerSnapshot]:
        """Each key's fork server, starting or ready, and its spares (for ``ddpctl daemon``; no I/O)."""
        return [ServerSnapshot.of(w, self._demand.get(w.key), self.spares.pids(w.key))
                for w in (*self._starting, *(w for q in self._ready.values() for w in q)) if w.server]

    # -- for attempts ----------------------------------------------------------------------

    @property
    def ready_pids(self) -> list[int]:
        return [w.pid for q in self._ready.values() for w in q]

    def serves(self, shape: Shape) -> bool:
        """Whether the pool may hold interpreters of this shape: another user's only where each
        pooled interpreter has a cgroup of its own (what its start forks must not escape)."""
        return self.size > 0 and (shape.identity is None or self.contained)

    def use(self, shape: Shape, ranks: int) -> None:
        """A job of this shape is starting `ranks` ranks: keep its key warm for the next one (any job's
        start wakes the pool: its refills yield the cores)."""
        if not self.serves(shape):
            self._wake.set()
            return
        now, known = time.monotonic(), shape.key in self._demand  # a known key's want may drop: claim
        self._claims.claim(shape.key, ranks if known and not self.fork else 0, now)  # (its takes come after)
        self._demand[shape.key] = Demand(shape, ranks, now)
        if self.fork:
            self._plans.ask(shape.key)
        if len(self._demand) > MAX_KEYS:  # the least recently used key goes first
            oldest = min(self._demand, key=lambda k: self._demand[k].last_used)
            del self._demand[oldest]
            self._plans.forget(oldest)
        self._wake.set()

    async def take(self, key: PoolKey, wait: float = 0.0) -> PoolWorker | None:
        """A ready worker of `key`, now the caller's (it leads its own process group and cgroup; a
        forked one, the process group only: the server's cgroup until the caller moves it); None:
        start cold. A fork server still starting (or about to: the key's first job) is waited for
        up to `wait` s (`_server`)."""
        if self.fork:
            self._wake.set()  # the key's spares are forked again in the background
            spare = self.spares.take(key)
            if spare is not None:
                return spare
            server = await self._server(key, wait)
            return None if server is None else await fork_from(server)
        self._claims.took(key)
        ready = self._ready.get(key)
        while ready:
            w = ready.popleft()
            w.taken = True
            self._workers.discard(w)
            w.scope.cancel()  # the watcher lets go of it (its pidfd wait ends at the next checkpoint)
            self._wake.set()
            if w.proc.poll() is not None:  # died a moment ago, before its watcher ran
                log.warning("pool.worker_died", pid=w.pid, exit=str(procs.Exit.from_returncode(w.proc.returncode)),
                            idle=True)
                w.channel.close()
                if w.cgroup is not None:
                    POOL.end(w.cgroup)
                continue
            assert w.hello is not None
            set_priority(w.pid, idle=False)
            log.info("pool.worker_taken", pid=w.pid, ready=len(ready), uid=key.uid, size=self.size)
            return w
        return None

    async def _server(self, key: PoolKey, wait: float) -> PoolWorker | None:
        """The key's ready fork server (it stays the pool's); None when there is none within `wait` s.

        A rank goes through a server that is starting rather than start cold beside it: the server's
        start is the import a cold rank would do, once for every rank (docs/pool.md, "A key's first
        job"). So a key whose demand is new waits for the pool's next plan (it spawns the server
        then, or not: the share, a backoff), and a server starting is waited for until it is ready
        or fails; all at most `wait` and ``pool_server_wait`` s from now, and ``pool_server_wait`` s
        from the server's spawn; then None: cold."""
        until = time.monotonic() + min(wait, self.server_wait)
        if self._plans.pending(key):  # the key's first job: its server is not planned yet
            with anyio.move_on_after(until - time.monotonic()):
                await self._plans.wait(key)
        if (ready := self._ready_server(key)) is not None:
            return ready
        starting = next((w for w in self._starting if w.key == key and w.server is not None and not w.retired), None)
        if starting is None or starting.server is None:
            return None
        since = time.monotonic()
        limit = min(until, starting.spawned_at + self.server_wait) - since
        if limit <= 0:
            return None
        starting.server.awaited = True  # it starts on the waiting job's cores now: never at idle priority
        if self.idle_priority:
            set_priority(starting.pid, idle=False)
            if starting.cgroup is not None:
                idle_cgroup(starting.cgroup, False)
        log.info("pool.server_waiting", server=starting.pid, uid=key.uid, at_most=round(limit, 3))
        with anyio.move_on_after(limit):
            await starting.server.settled.wait()
        server = self._ready_server(key)
        log.info("pool.server_awaited", server=starting.pid, uid=key.uid, ready=server is not None,
                 seconds=round(time.monotonic() - since, 3))
        return server

    def _ready_server(self, key: PoolKey) -> PoolWorker | None:
        return next((w for w in self._ready.get(key, ()) if w.proc.poll() is None), None)

    # -- the service -----------------------------------------------------------------------

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Keep each key's share ready or starting until cancelled; then kill and reap them all."""
        if self.subtree is not None:  # pool cgroups a killed daemon left behind (whatever the size now)
            await anyio.to_thread.run_sync(POOL.sweep, self.subtree.jobs)
        if self.size == 0:
            task_status.started()
            return
        try:
            async with anyio.create_task_group() as tg:
                task_status.started()
                log.info("pool.started", size=self.size, per_key=self.per_key, idle_expiry=self.idle_expiry,
                         log=str(self.log_path), fork_server=self.fork)
                while True:
                    self._plans.begin()
                    await self._fill(tg)
                    self._plans.end()
                    if self.fork and not self._closing:
                        await self.spares.sync(tg, self._ready, {k: d.ranks for k, d in self._demand.items()})
                    self._yield_to_jobs()
                    with anyio.move_on_after(self._sleep()):
                        await self._wake.wait()
                    self._wake = anyio.Event()
        finally:
            with anyio.CancelScope(shield=True):
                await self._close()

    def _sleep(self) -> float:
        """Until the next key expires or a backoff ends (or a day: a wake comes first)."""
        now = time.monotonic()
        times = [t for t in (next_expiry(self._demand, self.idle_expiry), *self._retry_at.values()) if t is not None]
        return max(0.01, min(times, default=now + 86400.0) - now)

    def _yield_to_jobs(self) -> None:
        """Refills at idle priority while jobs hold cores, else normal; held (cgroups frozen) beyond
        the cores the running jobs' ranks leave free, the oldest refills keeping those. A fork
        server's start is never held (it is once per key, and a job's ranks may be waiting for it:
        then at normal priority too)."""
        busy = self.busy_ranks()
        if busy > 0 or self._was_busy:  # (the wake at a job's end: busy until now)
            self._busy_at = time.monotonic()
        self._was_busy = busy > 0
        free = max(0, self._cores - busy)
        for i, w in enumerate(sorted(self._starting, key=lambda w: w.spawned_at)):
            if self.idle_priority:
                idle = busy > 0 and not (w.server is not None and w.server.awaited)
                set_priority(w.pid, idle=idle)
                if w.cgroup is not None:
                    idle_cgroup(w.cgroup, idle)
            hold = busy > 0 and i >= free and w.server is None  # a server's start: once per key, never held
            if w.cgroup is not None and w.held != hold:
                w.held = freeze_cgroup(w.cgroup, hold)
                log.info("pool.refill_held" if w.held else "pool.refill_released", pid=w.pid, busy=busy,
                         cores=self._cores, cgroup=str(w.cgroup.path))

    def _held(self) -> dict[PoolKey, int]:
        return Counter([w.key for q in self._ready.values() for w in q] + [w.key for w in self._starting])

    async def _fill(self, tg: TaskGroup) -> None:
        now = time.monotonic()
        todo = plan(self._demand, self._held(), total=self.size, per_key=self.per_key,
                    idle_expiry=self.idle_expiry, now=now)
        for key in todo.forget:
            del self._demand[key]
            self._failures.pop(key, None)
            self._claims.forget(key)
            self._plans.forget(key)
            log.info("pool.key_expired", key=key.label(), idle=self.idle_expiry)
        # and those still starting of keys no longer wanted, at once: one that never said Hello (a user's wrapper
        # that never execs python) was kept till the daemon stopped, with its core and its cgroup's escapees
        for w in [w for w in self._starting if w.key not in self._demand and not w.retired]:
            self._retire(w, starting=True)
        # backoffs still running, of keys still wanted (a past one must not wake the loop again)
        self._retry_at = {k: t for k, t in self._retry_at.items() if t > now and k in self._demand}
        for key, n in todo.retire.items():
            ready = self._ready.get(key, deque())
            for _ in range(min(n, len(ready) - self._claims.held(key, now))):  # a job's start lowered the want
                self._retire(ready.popleft())  # the oldest first
        for key, n in todo.spawn.items():
            if key in self._retry_at:
                continue
            for _ in range(n):
                if self._closing or not (self.fork or self._idle_core()) or key not in self._demand:
                    return
                new = await self._spawn(self._demand[key].shape)
                if new is None:
                    self._failed(key)
                    break
                self._starting.add(new)
                self._workers.add(new)
                if self.idle_priority and self.busy_ranks() > 0:  # at once: its threads inherit it
                    set_priority(new.pid, idle=True)
                tg.start_soon(self._watch, new)
                await anyio.lowlevel.checkpoint()  # let a waiting attempt run between spawns

    def _failed(self, key: PoolKey) -> None:
        n = self._failures[key] = self._failures.get(key, 0) + 1
        delay = min(BACKOFF_MAX, 2.0 ** (n - 1))
        self._retry_at[key] = time.monotonic() + delay
        log.warning("pool.backoff", seconds=delay, failures=n, key=key.label())
        self._wake.set()

    async def _spawn(self, shape: Shape) -> PoolWorker | None:
        """Start one pool worker of `shape` (the spawn itself from the event-loop thread)."""
        cgroup: Cgroup | None = None
        try:
            if self.subtree is not None:
                cgroup = await anyio.to_thread.run_sync(Cgroup.create, self.subtree.jobs,
                                                        f"pool-{os.getpid()}-{next(self._names)}")
            log_fd = await anyio.to_thread.run_sync(self._open_log, shape)
        except OSError as exc:
            await POOL.aend(cgroup)
            log.error("pool.spawn_failed", error=str(exc), key=shape.key.label())
            return None
        parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        argv = [*shape.argv, *worker_args(child_end.fileno(), os.getpid(), pool=True, fork_server=self.fork)]
        try:
            proc = procs.spawn(argv, env=shape.env, cwd=shape.cwd, log_fd=log_fd, pass_fds=[child_end.fileno()],
                               process_group=None, identity=shape.identity,
                               place=None if cgroup is None else cgroup.add, what="a pool interpreter's start")
        except OSError as exc:
            parent_end.close()
            await POOL.aend(cgroup)
            log.error("pool.spawn_failed", error=str(exc), key=shape.key.label())
            return None
        finally:
            child_end.close()
            os.close(log_fd)
        log.info("pool.worker_spawned", pid=proc.pid, uid=shape.key.uid)
        return PoolWorker(proc, WorkerChannel(parent_end), shape.key, dict(shape.env), cgroup,
                          server=ForkServer() if self.fork else None)

    def _open_log(self, shape: Shape) -> int:
        """pool.log: the daemon's for its own user's workers, else the user's own, in their tree."""
        if shape.identity is None:
            return procs.open_log(self.log_path)
        return create_user_file(self.config.state_dir, shape.identity, name=POOL_LOG)

    async def _watch(self, w: PoolWorker) -> None:
        """Read the worker's Hello, then wait on its pidfd until it dies or is taken."""
        with w.scope:
            try:
                hello, late = await self._hello(w)  # (the rest of the channel is the attempt's)
                self._starting.discard(w)
                if w.held and w.cgroup is not None:  # frozen just after its Hello: ready ones never are
                    w.held = freeze_cgroup(w.cgroup, False)
                if w.retired or not isinstance(hello, Hello) or hello.pid != w.pid:
                    self._kill(w)
                    exit_ = await procs.wait_exit(w.proc)
                    if not w.retired:  # (retired: its key was forgotten while it started)
                        if late:
                            reason = f"not ready within pool_start_timeout ({self.start_timeout:g} s)"
                        elif hello is None:
                            reason = "no hello: it ended, or its channel closed or broke"
                        else:
                            reason = "a wrong first frame"
                        log.error("pool.worker_failed", pid=w.pid, exit=str(exit_), log=str(self.log_path),
                                  first_frame=type(hello).__name__, uid=w.key.uid, reason=reason)
                        self._failed(w.key)
                    return
                self._failures.pop(w.key, None)
                w.hello = hello
                if w.server is not None:  # a server forks ranks: never at idle priority once ready
                    set_priority(w.pid, idle=False)
                    if w.cgroup is not None:
                        idle_cgroup(w.cgroup, False)
                if self._closing or w.key not in self._demand:  # forgotten while it started
                    self._kill(w)
                    await procs.wait_exit(w.proc)
                    return
                self._ready.setdefault(w.key, deque()).append(w)
                if w.server is not None:
                    w.server.settled.set()  # a job's rank waiting for it forks through it now
                self._wake.set()  # its core is free again: the next one may start
                log.info("pool.worker_ready", pid=w.pid, seconds=round(time.monotonic() - w.spawned_at, 3),
                         ready=len(self._ready[w.key]), uid=w.key.uid, size=self.size, server=w.server is not None)
                exit_ = await procs.wait_exit(w.proc)
                if not (self._closing or w.retired):
                    log.warning("pool.worker_died", pid=w.pid, exit=str(exit_), idle=True)
            finally:
                self._starting.discard(w)
                if w.server is not None:
                    w.server.settled.set()  # (failed or retired: a rank waiting for it starts cold)
                ready = self._ready.get(w.key)
                if ready is not None and w in ready:
                    ready.remove(w)
                if ready is not None and not ready and w.key not in self._demand:
                    del self._ready[w.key]
                if w.proc.returncode is not None:  # reaped; else (shutdown) `_close` kills it
                    self._workers.discard(w)
                    w.channel.close()
                    if not w.taken:
                        await POOL.aend(w.cgroup)  # shielded: whatever it left in its cgroup dies with it
                if not w.taken:
                    self._wake.set()

    async def _hello(self, w: PoolWorker) -> tuple[WorkerMessage | None, bool]:
        """The member's first frame (`first_frame`), and whether it was late: (None, True) when it has
        not come within `start_timeout` s in which no job held cores (a refill yields to jobs by design)."""
        since = time.monotonic()
        while True:
            with anyio.move_on_after(max(0.0, since + self.start_timeout - time.monotonic())):
                return await w.channel.first_frame(w.pid), False
            if self.busy_ranks() > 0:
                since = time.monotonic()
            elif self._busy_at > since:
                since = self._busy_at
            else:
                return None, True

    def _retire(self, w: PoolWorker, **facts: bool) -> None:
        w.retired = True
        log.info("pool.worker_retired", pid=w.pid, uid=w.key.uid, **facts)
        self._kill(w)  # its watcher reaps it and ends its cgroup, whatever it left there

    def _kill(self, w: PoolWorker) -> None:
        if w.proc.returncode is None:  # not reaped yet: the pid is still ours (it leads its own group until taken)
            kill(w.pid)

    async def _close(self) -> None:
        self._closing = True
        await self.spares.drop()
        left = list(self._workers)
        self._ready.clear()
        for w in left:
            w.channel.close()
            self._kill(w)
        with anyio.move_on_after(SHUTDOWN_WAIT):
            for w in left:
                await procs.wait_exit(w.proc)
        for w in left:
            await POOL.aend(w.cgroup)
        alive = [w.pid for w in left if w.proc.poll() is None]
        log.info("pool.stopped", killed=[w.pid for w in left], unkillable=alive)

