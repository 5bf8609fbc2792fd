"""The daemon: one event loop, one root task group owning every service."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import structlog
from anyio.abc import SocketListener, TaskStatus

from .. import __version__
from ..protocol import PROTOCOL_VERSION
from ..protocol.control import DaemonInfo
from .config import Config, ConfigError, load_config, parse_listen, reloaded
from .contain.cgroups import JOBS_DIR, Subtree, prepare_subtree, probe, remove_emptied
from .contain.portfence import daemon_tag, fences
from .contain.procs import set_child_subreaper
from .contain.reaper import reap_forever
from .contain.usertree import ensure_base
from .control.door import accept_forever
from .control.handlers import Services
from .control.interpreters import CHECKS
from .control.metrics import Metrics, MetricsServer
from .control.server import ControlServer, prepare_socket_path, secure_socket
from .gpu.gpus import GpuInfo, daemon_devices
from .gpu.utilisation import UtilisationLog
from .logs import configure_logging, parse_level, set_level
from .multinode.agentproc import AGENTS
from .notify import SystemdNotifier, listen_fds
from .pool.pool import WarmPool
from .pool.poolkeys import own_shape
from .queue.facade import JobQueue, LiveConfig
from .queue.resources import Resources
from .store.bus import EventBus
from .store.curves import CurveStore
from .store.journal import Journal
from .store.private import DAEMON_UMASK, private_umask
from .store.state import StateDB

log = structlog.get_logger("ddpd")


async def _gpus(configured: int | None) -> list[GpuInfo]:
    """The devices to schedule (gpu.gpus.daemon_devices): the daemon never initialises CUDA itself."""
    found, problem = await daemon_devices(configured)
    if problem is not None:
        log.warning("daemon.gpu_discovery_failed", error=problem)
    log.info("daemon.gpus", gpus=[f"{g.label} {g.uuid} {g.name}".strip() for g in found])
    return found


class Daemon:
    def __init__(self, config: Config, overrides: dict[str, Any] | None = None,
                 inherited_umask: int = DAEMON_UMASK) -> None:
        self.live = LiveConfig(config)  # the one current config: the queue and control read it, a reload replaces it
        self.inherited_umask = inherited_umask  # what started it had (said once it is ready)
        self.overrides = overrides or {}
        self.started = time.monotonic()
        self.notifier = SystemdNotifier()
        self._stop = anyio.Event()
        self._stop_count = 0
        self._adopted = False
        self._socket_path: Path = config.socket
        self.queue: JobQueue | None = None
        self.pool: WarmPool | None = None

    @property
    def config(self) -> Config:
        """The daemon's config now (`reload` replaces it)."""
        return self.live.current

    def counts(self) -> tuple[int, int]:
        """Jobs starting or running (restarts included), and jobs queued, by their recorded state."""
        if self.queue is None:
            return 0, 0
        now = self.queue.jobs.overview()
        return now.active, now.queued

    def info(self) -> DaemonInfo:
        assert self.queue is not None
        now = self.queue.jobs.overview()
        return DaemonInfo(
            version=__version__, protocol=PROTOCOL_VERSION, pid=os.getpid(),
            uptime=round(time.monotonic() - self.started, 3), socket=str(self._socket_path),
            state_dir=str(self.config.state_dir), running=now.active, queued=now.queued,
            cpu_slots=now.cpu_slots, gpus=now.gpus, free_cpu_slots=now.free_cpu_slots,
            free_gpus=now.free_gpus, pool_ready=None if self.pool is None else len(self.pool.ready_pids),
            pool_state=None if self.pool is None else self.pool.state(),
        )

    async def reload(self) -> None:
        """Re-read the config file: limits, defaults and log level; running jobs are untouched.

        New attempts use the new config; a running attempt keeps the config it started with.
        """
        old = self.config
        self.notifier.send("RELOADING=1", f"MONOTONIC_USEC={time.monotonic_ns() // 1000}")
        try:
            new = await anyio.to_thread.run_sync(lambda: load_config(old.config_file, **self.overrides))
        except ConfigError as exc:
            log.error("daemon.reload_failed", error=str(exc), config_file=str(old.config_file))
            raise
        finally:
            self.notifier.send("READY=1")  # a reload ends (failed or not): systemctl reload returns
        new, changed, ignored = reloaded(old, new)  # the keys marked RESTART keep their old value
        if self.queue is None:
            self.live.replace(new)
        else:
            self.queue.reconfigure(new)  # the live config replaced, and what it changes at once
        set_level(new.log_level)
        # at info, or at the new level when that hides info lines: a reload always shows in the log
        level = new.log_level.lower() if parse_level(new.log_level) > logging.INFO else "info"
        getattr(log, level)("daemon.reloaded", log_level=new.log_level, changed=changed, needs_restart=ignored,
                            config_file=None if new.config_file is None else str(new.config_file))

    def _status(self) -> None:
        running, queued = self.counts()
        prefix = "stopping: " if self._stop.is_set() else ""
        text = f"{prefix}{running} running, {queued} queued"
        if self.notifier.status(text):
            log.debug("daemon.status", running=running, queued=queued, stopping=self._stop.is_set())

    async def _follow_status(self, bus: EventBus) -> None:
        """STATUS= on every change of the counts (submissions, state changes, cancellations)."""
        while True:  # the bus drops a subscriber that falls behind: subscribe again
            async with bus.subscribe() as stream:
                self._status()
                async for event in stream:
                    if event.kind in ("job.submitted", "job.state_changed"):
                        self._status()

    async def _signals(self, signals: Any) -> None:
        async for signum in signals:
            name = signal.Signals(signum).name
            if signum == signal.SIGHUP:
                log.info("daemon.reload_requested", signal=name)
                try:
                    await self.reload()
                except ConfigError:
                    pass
                continue
            self._stop_count += 1
            log.info("daemon.stop_requested", signal=name, count=self._stop_count,
                     force=self._stop_count > 1)
            if self._stop_count == 1:
                self._stop.set()
            elif self.queue is not None:
                await self.queue.force_stop()

    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        # signals are received from the start: one arriving during recovery waits for the handler task
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
            await self._serve(signals, task_status)

    async def _serve(self, signals: Any, task_status: TaskStatus[None]) -> None:
        cfg = self.config
        db = await anyio.to_thread.run_sync(StateDB.open_dir, cfg.state_dir)  # StorageError: unusable
        await anyio.to_thread.run_sync(ensure_base, cfg.state_dir)  # root's 0711; users/<uid>/ are the users'
        subtree = await anyio.to_thread.run_sync(containment, cfg)
        await anyio.to_thread.run_sync(open_fences, cfg)  # before any job: a killed run's rules swept
        set_child_subreaper()
        if subtree is not None:  # interpreter checks a killed daemon left running
            await anyio.to_thread.run_sync(CHECKS.sweep, subtree.jobs)
            await anyio.to_thread.run_sync(AGENTS.sweep, subtree.jobs)  # and its jobs' rendezvous agents
        gpus = await _gpus(cfg.gpus)
        bus = EventBus()
        journal = Journal(db, bus)
        curves = CurveStore(journal)
        bus.listen(curves.observe)
        resources = Resources(gpus, cfg.cpu_slots)
        pool = WarmPool(cfg, resources.busy_cpu, subtree)  # warm workers (pool_size 0: none, all start cold)
        self.pool = pool if pool.size else None
        if os.geteuid() != 0 or cfg.allow_root_jobs:  # the daemon's own user is served: its key is known now
            pool.use(own_shape(cfg), 1)  # two interpreters, until a job of it says how many ranks it has
        utilization = UtilisationLog()  # the GPUs' recent utilisation: the idle watch's, read by the views
        self.queue = queue = JobQueue(self.live, journal, resources, self.pool, subtree=subtree,
                                      utilization=utilization)
        jobs = queue.jobs  # what control and metrics ask of the queue
        listener: SocketListener | None = None
        try:
            await queue.recover()
            metrics = metrics_listener = None
            if cfg.metrics_listen is not None:
                metrics = Metrics(jobs.overview, resources, self.started, __version__, curves)
                host, port = parse_listen(cfg.metrics_listen)
                metrics_listener = await MetricsServer.listen(host, port)  # a bind error stops the start
            listener = await self._listen()
            services = Services(self.live, journal, resources, utilization, subtree)
            server = ControlServer(jobs, services, self.info, self.reload, curves, pool=self.pool)
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._signals, signals)
                tg.start_soon(reap_forever)  # a subreaper: every inherited zombie is reaped
                tg.start_soon(self._follow_status, bus)
                tg.start_soon(curves.run)
                await tg.start(pool.run)
                tg.start_soon(queue.run)
                tg.start_soon(accept_forever, listener, server.handle, "control")
                tg.start_soon(self.notifier.watchdog)
                if metrics is not None and metrics_listener is not None:
                    tg.start_soon(metrics.consume, bus)
                    tg.start_soon(MetricsServer(metrics.render, cfg.metrics_token).serve, metrics_listener)
                running, queued = self.counts()
                log.info("daemon.ready", version=__version__, pid=os.getpid(), socket=str(self._socket_path),
                         socket_activated=self._adopted, state_dir=str(cfg.state_dir), gpus=gpus,
                         cpu_slots=cfg.cpu_slots, running=running, queued=queued,
                         watchdog_interval=self.notifier.watchdog_interval, umask=f"{DAEMON_UMASK:04o}",
                         inherited_umask=f"{self.inherited_umask:04o}")
                self.notifier.send("READY=1")
                self._status()
                task_status.started()
                await self._stop.wait()
                self.notifier.send("STOPPING=1")
                self._status()
                running, queued = self.counts()
                log.info("daemon.stopping", running=running, queued=queued,
                         kill_grace=self.config.defaults.kill_grace)
                await queue.shutdown(force=False)
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                if listener is not None:
                    await listener.aclose()
                    if not self._adopted:
                        try:
                            self._socket_path.unlink()
                        except FileNotFoundError:
                            pass
                db.close()
                if subtree is not None:
                    await anyio.to_thread.run_sync(_remove_empty, subtree)
                running, queued = self.counts()
                log.info("daemon.stopped", uptime=round(time.monotonic() - self.started, 3), queued=queued,
                         running=running)
                self.notifier.close()

    async def _listen(self) -> SocketListener:
        cfg = self.config
        adopted = listen_fds()
        if adopted:
            self._adopted = True
            for extra in adopted[1:]:
                extra.close()
            sock = adopted[0]
            name = sock.getsockname()
            if isinstance(name, str) and name:
                self._socket_path = Path(name)
            return await SocketListener.from_socket(sock)
        await anyio.to_thread.run_sync(prepare_socket_path, cfg.socket)
        listener = await anyio.create_unix_listener(cfg.socket)
        await anyio.to_thread.run_sync(secure_socket, cfg.socket, cfg.socket_mode, cfg.socket_group)
        return listener


def open_fences(cfg: Config) -> None:
    """This daemon's port fences (contain.portfence): its table made, what killed daemons left
    swept; where they cannot work, said once here (and at each multi-node submit)."""
    found = fences(daemon_tag(cfg.state_dir), cfg.nft_library)
    if found.unavailable:
        log.warning("fence.unavailable", reason=found.unavailable, allow_unfenced=cfg.allow_unfenced,
                    multinode="runs unfenced" if cfg.allow_unfenced else "refused")
    else:
        log.info("fence.ready", table=f"inet {found.tag}", owned=found.owned)


def _remove_empty(subtree: Subtree) -> None:
    """At the stop: the attempts' cgroups that emptied after their attempt ended (an unkillable rank
    that died later), then the daemon's own folder where it is ours alone; a populated one is kept
    (reported when its attempt ended)."""
    removed = remove_emptied(subtree.jobs)
    if removed:
        log.info("cgroup.emptied_removed", paths=[str(p) for p in removed])
    if subtree.jobs.name != JOBS_DIR:  # ours alone, under the root cgroup
        with contextlib.suppress(OSError):
            subtree.jobs.rmdir()


def containment(cfg: Config) -> Subtree | None:
    """The daemon's cgroup subtree for attempts (blocking), or None: process groups and markers only."""
    if cfg.cgroup == "off":
        log.info("cgroup.unavailable", reason="cgroup = off in the config")
        return None
    support = probe()
    if not support.usable or support.path is None:
        log.info("cgroup.unavailable", reason=support.reason)
        return None
    instance = hashlib.sha256(str(cfg.state_dir.resolve()).encode()).hexdigest()[:12]
    try:
        subtree = prepare_subtree(support.path, instance)
    except OSError as exc:
        log.warning("cgroup.unavailable", reason=f"cannot prepare {support.path}: {exc}")
        return None
    log.info("cgroup.ready", path=str(subtree.jobs), controllers=sorted(subtree.controllers),
             unavailable=subtree.unavailable)
    return subtree


def run(config: Config, overrides: dict[str, Any] | None = None) -> None:
    configure_logging(config.log_level, config.log_format)
    was = private_umask()  # before anything is created: the database is never others' (store.private)
    anyio.run(Daemon(config, overrides, inherited_umask=was).serve)
