"""Daemon configuration: built-in defaults, then the TOML file, then command-line flags."""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..protocol.paths import daemon_socket_path, daemon_state_dir
from .logs import parse_level


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class Defaults:
    """Daemon-wide defaults for each job-spec timeout, in seconds (wall None: unlimited)."""

    join: float = 120.0
    heartbeat: float = 10.0
    progress: float = 600.0
    wall: float | None = None
    kill_grace: float = 5.0
    stop_warning: float = 30.0


@dataclass(frozen=True)
class Config:
    socket: Path = field(default_factory=daemon_socket_path)
    state_dir: Path = field(default_factory=daemon_state_dir)
    socket_mode: int = 0o660
    socket_group: str | None = None
    store_host: str = "127.0.0.1"
    port_range: tuple[int, int] | None = None  # None: an ephemeral port per attempt
    heartbeat_interval: float = 1.0
    cpu_slots: int = field(default_factory=lambda: os.cpu_count() or 1)
    gpus: int | None = None  # None: ask torch at start
    pool_size: int = 0
    worker_command: tuple[str, ...] = ()  # argv prefix of a worker; () is `sys.executable -m ddpd.worker`
    max_running: int = 64
    log_level: str = "info"
    log_format: str = "auto"  # auto | json | console
    metrics_listen: str | None = None  # "HOST:PORT" of the Prometheus endpoint; None: off
    metrics_token: str | None = None  # bearer token the endpoint requires (mandatory off loopback)
    # limits (issue: nothing a client or a job sends is unbounded)
    max_queued: int = 10_000  # jobs waiting in the queue, all users together
    max_queued_per_user: int = 1_000
    priority_range: tuple[int, int] = (-1000, 1000)  # the band a job's priority must lie in
    max_kill_grace: float = 60.0  # a job's kill_grace at most (keep under the unit's TimeoutStopSec)
    retention: float = 30 * 86400.0  # seconds an ended job (row, events, logs, checkpoints) is kept; 0: forever
    max_connections: int = 256  # control connections open at once
    idle_timeout: float = 600.0  # a control connection with no complete request for this long is closed
    frame_timeout: float = 10.0  # a request frame must be complete within this many seconds of its first byte
    rank_frames_per_second: int = 2_000  # frames a rank may send per second (averaged); a flood fails the job
    rank_log_max: int = 256 * 1024 * 1024  # bytes of a rank log before it rotates (the newest part is kept)
    defaults: Defaults = field(default_factory=Defaults)
    config_file: Path | None = None

    def with_overrides(self, **kw: Any) -> Config:
        return dataclasses.replace(self, **{k: v for k, v in kw.items() if v is not None})


_TOP_KEYS = {f.name for f in dataclasses.fields(Config)} - {"defaults", "config_file"}
_DEFAULT_KEYS = {f.name for f in dataclasses.fields(Defaults)}


def load_config(path: Path | None, **overrides: Any) -> Config:
    """Read the TOML file (if any) and apply flag overrides; unknown keys are errors."""
    cfg = Config()
    if path is not None:
        try:
            data = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path}: {exc}") from None
        cfg = _apply(cfg, data, str(path))
        cfg = dataclasses.replace(cfg, config_file=path)
    cfg = cfg.with_overrides(**overrides)
    check_config(cfg)
    return cfg


def parse_listen(value: str) -> tuple[str, int]:
    """"HOST:PORT" or "[V6]:PORT" (port 0: any free port) into (host, port)."""
    host, sep, port = value.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(f"metrics_listen {value!r} is not HOST:PORT")
    return host, int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_config(cfg: Config) -> None:
    """Checks across keys, after the file and the flags are merged."""
    if cfg.metrics_listen is not None:
        host, _ = parse_listen(cfg.metrics_listen)
        if not is_loopback(host) and not cfg.metrics_token:
            raise ConfigError(f"metrics_listen {cfg.metrics_listen!r} is not loopback: set metrics_token too")
    if cfg.max_running < 1 or cfg.cpu_slots < 1:
        raise ConfigError("max_running and cpu_slots must be at least 1")
    if cfg.log_format not in ("auto", "json", "console"):
        raise ConfigError(f"log_format {cfg.log_format!r}: use auto, json or console")
    try:
        parse_level(str(cfg.log_level))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _apply(cfg: Config, data: dict[str, Any], where: str) -> Config:
    kw: dict[str, Any] = {}
    for key, value in data.items():
        if key == "defaults":
            if not isinstance(value, dict) or set(value) - _DEFAULT_KEYS:
                raise ConfigError(f"{where}: [defaults] accepts {sorted(_DEFAULT_KEYS)}")
            kw["defaults"] = dataclasses.replace(cfg.defaults, **value)
        elif key in _TOP_KEYS:
            if key in ("socket", "state_dir"):
                value = Path(value)
            elif key == "port_range":
                if not (isinstance(value, list) and len(value) == 2 and 0 < value[0] <= value[1] < 65536):
                    raise ConfigError(f"{where}: port_range must be [first, last] within 1..65535")
                value = (int(value[0]), int(value[1]))
            elif key == "worker_command":
                if not (isinstance(value, list) and value and all(isinstance(v, str) for v in value)):
                    raise ConfigError(f"{where}: worker_command must be a non-empty list of strings")
                value = tuple(value)
            elif key == "socket_mode" and isinstance(value, str):
                value = int(value, 8)
            kw[key] = value
        else:
            raise ConfigError(f"{where}: unknown key {key!r}")
    return dataclasses.replace(cfg, **kw)
