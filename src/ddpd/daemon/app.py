"""The daemon: one event loop, one root task group owning every service."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import anyio
import anyio.to_thread
import structlog
from anyio.abc import SocketListener, TaskStatus

from .. import __version__
from ..protocol import PROTOCOL_VERSION
from ..protocol.control import DaemonInfo
from .config import Config, ConfigError, load_config
from .jobs import EventBus, Journal
from .logs import configure_logging, set_level
from .notify import Notifier, listen_fds
from .pool import WarmPool
from .procs import set_child_subreaper
from .scheduler import Resources, Scheduler
from .server import ControlServer, prepare_socket_path, secure_socket
from .state import StateDB
from .supervisor import Attempt

log = structlog.get_logger("ddpd")


def _count_gpus() -> int:
    import torch

    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


class Daemon:
    def __init__(self, config: Config, overrides: dict[str, Any] | None = None) -> None:
        self.config = config
        self.overrides = overrides or {}
        self.started = time.monotonic()
        self.notifier = Notifier()
        self._stop = anyio.Event()
        self._stop_count = 0
        self.scheduler: Scheduler | None = None

    def info(self) -> DaemonInfo:
        assert self.scheduler is not None
        running, queued = self.scheduler.counts()
        res = self.scheduler.resources
        return DaemonInfo(
            version=__version__, protocol=PROTOCOL_VERSION, pid=os.getpid(),
            uptime=round(time.monotonic() - self.started, 3), socket=str(self.config.socket),
            state_dir=str(self.config.state_dir), running=running, queued=queued,
            cpu_slots=res.total_cpu, gpus=res.total_gpus,
        )

    async def reload(self) -> None:
        """Re-read the config file: limits, defaults and log level; running jobs are untouched."""
        try:
            new = load_config(self.config.config_file, **self.overrides)
        except ConfigError as exc:
            log.error("daemon.reload_failed", error=str(exc))
            raise
        keep = {"socket": self.config.socket, "state_dir": self.config.state_dir}
        self.config = new.with_overrides(**keep)
        set_level(self.config.log_level)
        if self.scheduler is not None:
            self.scheduler.config = self.config
        log.info("daemon.reloaded", log_level=self.config.log_level, config_file=str(self.config.config_file))

    def _status(self) -> None:
        if self.scheduler is not None:
            running, queued = self.scheduler.counts()
            self.notifier.send(f"STATUS={running} running, {queued} queued")

    async def _signals(self) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
            async for signum in signals:
                if signum == signal.SIGHUP:
                    try:
                        await self.reload()
                    except ConfigError:
                        pass
                    continue
                self._stop_count += 1
                log.info("daemon.stop_requested", signal=signal.Signals(signum).name, count=self._stop_count)
                if self._stop_count == 1:
                    self._stop.set()
                elif self.scheduler is not None:
                    for attempt in list(self.scheduler.attempts.values()):
                        attempt.force()

    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        cfg = self.config
        await anyio.to_thread.run_sync(lambda: cfg.state_dir.mkdir(parents=True, exist_ok=True))
        set_child_subreaper()
        gpus = cfg.gpus if cfg.gpus is not None else await anyio.to_thread.run_sync(_count_gpus)
        db = await anyio.to_thread.run_sync(StateDB, cfg.state_dir / "ddpd.db")
        journal = Journal(db, EventBus())
        journal.on_change.append(self._status)
        self.scheduler = scheduler = Scheduler(cfg, journal, Resources(gpus, cfg.cpu_slots))
        await scheduler.recover()
        listener = await self._listen()
        server = ControlServer(scheduler, self.info, self.reload)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._signals)
                pool = WarmPool(cfg)  # warm workers (pool_size 0: none, every rank starts cold)
                Attempt.pool = pool if pool.size else None
                await tg.start(pool.run)
                tg.start_soon(scheduler.run, tg)
                tg.start_soon(listener.serve, server.handle)
                tg.start_soon(self.notifier.watchdog)
                log.info("daemon.ready", version=__version__, pid=os.getpid(), socket=str(cfg.socket),
                         state_dir=str(cfg.state_dir), gpus=gpus, cpu_slots=cfg.cpu_slots)
                self.notifier.send("READY=1")
                self._status()
                task_status.started()
                await self._stop.wait()
                self.notifier.send("STOPPING=1")
                running, queued = scheduler.counts()
                log.info("daemon.stopping", running=running, queued=queued)
                await scheduler.shutdown(force=False)
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await listener.aclose()
                if not self._adopted:
                    try:
                        cfg.socket.unlink()
                    except FileNotFoundError:
                        pass
                db.close()
                log.info("daemon.stopped")

    async def _listen(self) -> SocketListener:
        cfg = self.config
        adopted = listen_fds()
        self._adopted = bool(adopted)
        if adopted:
            return await SocketListener.from_socket(adopted[0])
        await anyio.to_thread.run_sync(prepare_socket_path, cfg.socket)
        listener = await anyio.create_unix_listener(cfg.socket)
        await anyio.to_thread.run_sync(secure_socket, cfg.socket, cfg.socket_mode, cfg.socket_group)
        return listener


def run(config: Config, overrides: dict[str, Any] | None = None) -> None:
    configure_logging(config.log_level, config.log_format)
    anyio.run(Daemon(config, overrides).serve)
