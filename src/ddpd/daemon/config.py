"""Daemon configuration: built-in defaults, then the TOML file, then command-line flags.

`Config` is a frozen dataclass (the shape the daemon reads); every value it may hold is typed and
ranged by the msgspec schema `ConfigSchema`, which checks the file as read and the merged result.
Any problem is one ConfigError whose message names the key. A metrics token may come from
`metrics_token_file`, which must be a regular file owned by the daemon's user or root and readable
by no one else; a config file that holds `metrics_token` itself and is readable by others is
reported with a warning.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import stat
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from ..protocol.paths import daemon_socket_path, daemon_state_dir
from ..protocol.spec import PRIORITY_LIMIT, Timeouts
from .logs import parse_level, warn_early

DAY = 86400.0


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

    def resolve(self, spec: Timeouts) -> JobTimeouts:
        """A job's timeouts: its spec's where it sets them, these defaults elsewhere."""
        return JobTimeouts(join=spec.join or self.join, heartbeat=spec.heartbeat or self.heartbeat,
                           progress=spec.progress or self.progress, wall=spec.wall or self.wall,
                           kill_grace=spec.kill_grace or self.kill_grace,
                           stop_warning=spec.stop_warning or self.stop_warning)


@dataclass(frozen=True)
class JobTimeouts:
    """One job's timeouts, resolved (`Defaults.resolve`), in seconds; wall None: no wall-time limit.
    What the scheduler, the attempt's deadlines and teardown, and the ranks' collective timeout read."""

    join: float
    heartbeat: float
    progress: float
    wall: float | None
    kill_grace: float
    stop_warning: float


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
    pool_size: int = 4  # warm interpreters in all (0: none); see docs/pool.md for the memory each holds
    pool_per_key: int = 4  # per (user, interpreter, start-up environment): 2 jobs' worth of a 2-rank job
    pool_idle_expiry: float = 600.0  # seconds a key stays warm after its last job started
    worker_command: tuple[str, ...] = ()  # argv prefix of a worker; () is `sys.executable -m ddpd.worker`
    max_running: int = 64
    log_level: str = "info"
    log_format: str = "auto"  # auto | json | console | human | journald (see logs)
    metrics_listen: str | None = None  # "HOST:PORT" of the Prometheus endpoint; None: off
    metrics_token: str | None = None  # bearer token the endpoint requires (mandatory off loopback)
    metrics_token_file: Path | None = None  # a 0600 file holding the token instead
    metrics_public: bool = False  # serve the endpoint without a token (every local user sees every job)
    # limits (issue: nothing a client or a job sends is unbounded)
    max_queued: int = 10_000  # jobs waiting in the queue, all users together
    max_queued_per_user: int = 1_000
    max_gpus_per_user: int | None = None  # GPUs one user's running jobs may hold together; None: no limit
    priority_range: tuple[int, int] = (-1000, 1000)  # the band a job's priority must lie in
    # priority above the default (0) is the operator's to grant (docs/usage.md, "Sharing the box"): the
    # highest a user may ask for is the greatest of priority_ceiling, its own entry and its groups'
    # entries; root, the daemon's own user and admin_group members are bounded by priority_range alone
    priority_ceiling: int = 0
    user_priority_ceilings: Mapping[str, int] = field(default_factory=dict)  # user name -> ceiling
    group_priority_ceilings: Mapping[str, int] = field(default_factory=dict)  # group name -> ceiling of members
    max_kill_grace: float = 60.0  # a job's kill_grace at most (keep under the unit's TimeoutStopSec)
    # fair share and preemption (docs/usage.md, "Sharing the box")
    fairshare_half_life: float = 7 * 86400.0  # seconds for a user's recorded usage to halve; 0: no decay
    preemptible_below: int | None = None  # a job of priority below this is preemptible as if --preemptible
    preempt_min_run: float = 300.0  # seconds a job runs before it may be preempted (again)
    preempt_scripts: bool = False  # preempt scripts that never call the stop API (ddpd.worker.api.should_stop)
    stop_signal: str = "SIGUSR1"  # raised in a script rank that handles it when it is asked to stop; "none": never
    # the scheduling policy of a CPU job's ranks (docs/operations.md): "batch" (SCHED_BATCH: their
    # threads' wake-ups never preempt each other, the ranks' gloo threads no longer interrupt the
    # training thread hundreds of times a second) or "normal" (SCHED_OTHER); GPU jobs stay normal
    cpu_rank_policy: str = "batch"
    retention: float = 30 * 86400.0  # seconds an ended job (row, events, logs, checkpoints) is kept; 0: forever
    # one user's history (docs/operations.md, "Limits and retention"): past either bound, that user's
    # oldest ended jobs are retired (as `rm` does), never another user's; 0: no bound
    max_history_per_user: int = 1_000  # ended jobs of one uid kept
    max_history_bytes_per_user: int = 64 * 1024 * 1024  # bytes of the database they take (spec, events, ranks)
    max_connections: int = 256  # control connections open at once
    max_connections_per_user: int = 32  # of them one uid may hold (root and the admin group: a reserve too)
    idle_timeout: float = 600.0  # a control connection with no complete request for this long is closed
    frame_timeout: float = 10.0  # a request frame must be complete within this many seconds of its first byte
    rank_frames_per_second: int = 2_000  # frames a rank may send per second (averaged); a flood fails the job
    rank_log_max: int = 256 * 1024 * 1024  # bytes of a rank log before it rotates (the newest part is kept)
    # identity and containment (docs/identity.md)
    allow_root_jobs: bool = False  # a root daemon refuses jobs of uid 0 unless this is set
    admin_group: str | None = None  # members see every job's detail, as root does
    cgroup: str = "auto"  # auto: one cgroup per attempt where cgroup v2 is writable; off: process groups only
    # port fences (docs/identity.md): without one, a multi-node job's store and endpoint are open to
    # every local user, so such a job is refused unless this is set
    allow_unfenced: bool = False
    nft_library: str = "libnftables.so.1"  # the nftables library the fences go through (a path, or a name)
    interpreter_check_timeout: float = 60.0  # seconds the submit-time `import torch, ddpd.worker` may take
    interpreter_checks_per_user: int = 2  # of those checks one user may run at once
    gpu_sample_interval: float = 10.0  # seconds between samples of each GPU's utilisation (NVML)
    gpu_idle_after: float | None = 3600.0  # a job whose GPUs stay at 0% this long is warned; None: never
    gpu_idle_cancel: bool = False  # ... and cancelled (reason gpu_idle)
    notify: str | None = None  # a command run (as the submitter) when any job ends, restarts or is preempted
    notify_url: str | None = None  # or a URL that gets the same as a JSON POST
    notify_timeout: float = 30.0  # seconds one run of a notification hook may take (then killed; retried once)
    defaults: Defaults = field(default_factory=Defaults)
    config_file: Path | None = None

    def with_overrides(self, **kw: Any) -> Config:
        return dataclasses.replace(self, **{k: v for k, v in kw.items() if v is not None})


# -- the schema: every key's type and range ------------------------------------------------------

_Pos = msgspec.Meta(gt=0)
Text = Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
Priority = Annotated[int, msgspec.Meta(gt=-PRIORITY_LIMIT, lt=PRIORITY_LIMIT)]
Timeout = Annotated[float, msgspec.Meta(gt=0, le=7 * DAY)]
Count = Annotated[int, msgspec.Meta(ge=1, le=10_000_000)]
Ceiling = Annotated[int, msgspec.Meta(ge=0, lt=PRIORITY_LIMIT)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
Ceilings = Annotated[dict[Name, Ceiling], msgspec.Meta(max_length=10_000)]


class DefaultsSchema(msgspec.Struct, forbid_unknown_fields=True):
    join: Timeout = 120.0
    heartbeat: Timeout = 10.0
    progress: Timeout = 600.0
    wall: Timeout | None = None
    kill_grace: Timeout = 5.0
    stop_warning: Timeout = 30.0


class ConfigSchema(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Every key of the config file with its type and range (unset keys keep the built-in value)."""

    socket: Text | msgspec.UnsetType = msgspec.UNSET
    state_dir: Text | msgspec.UnsetType = msgspec.UNSET
    socket_mode: Annotated[int, msgspec.Meta(ge=0, le=0o777)] | msgspec.UnsetType = msgspec.UNSET
    socket_group: Annotated[str, msgspec.Meta(min_length=1, max_length=64)] | msgspec.UnsetType | None = (
        msgspec.UNSET)
    store_host: Annotated[str, msgspec.Meta(min_length=1, max_length=255)] | msgspec.UnsetType = msgspec.UNSET
    port_range: tuple[Port, Port] | msgspec.UnsetType | None = msgspec.UNSET
    heartbeat_interval: Annotated[float, msgspec.Meta(gt=0, le=60)] | msgspec.UnsetType = msgspec.UNSET
    cpu_slots: Annotated[int, msgspec.Meta(ge=1, le=1 << 16)] | msgspec.UnsetType = msgspec.UNSET
    gpus: Annotated[int, msgspec.Meta(ge=0, le=1024)] | msgspec.UnsetType | None = msgspec.UNSET
    pool_size: Annotated[int, msgspec.Meta(ge=0, le=1024)] | msgspec.UnsetType = msgspec.UNSET
    pool_per_key: Annotated[int, msgspec.Meta(ge=0, le=1024)] | msgspec.UnsetType = msgspec.UNSET
    pool_idle_expiry: Annotated[float, msgspec.Meta(gt=0, le=30 * 86400)] | msgspec.UnsetType = msgspec.UNSET
    worker_command: Annotated[list[Text], msgspec.Meta(max_length=64)] | msgspec.UnsetType = msgspec.UNSET
    max_running: Annotated[int, msgspec.Meta(ge=1, le=100_000)] | msgspec.UnsetType = msgspec.UNSET
    log_level: Literal["debug", "info", "warning", "error", "DEBUG", "INFO", "WARNING", "ERROR"] | (
        msgspec.UnsetType) = msgspec.UNSET
    log_format: Literal["auto", "json", "console", "human", "journald"] | msgspec.UnsetType = msgspec.UNSET
    metrics_listen: Annotated[str, msgspec.Meta(min_length=1, max_length=300)] | msgspec.UnsetType | None = (
        msgspec.UNSET)
    metrics_token: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)] | msgspec.UnsetType | None = (
        msgspec.UNSET)
    metrics_token_file: Text | msgspec.UnsetType | None = msgspec.UNSET
    metrics_public: bool | msgspec.UnsetType = msgspec.UNSET
    max_queued: Count | msgspec.UnsetType = msgspec.UNSET
    max_queued_per_user: Count | msgspec.UnsetType = msgspec.UNSET
    max_gpus_per_user: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)] | msgspec.UnsetType | None = msgspec.UNSET
    priority_range: tuple[Priority, Priority] | msgspec.UnsetType = msgspec.UNSET
    priority_ceiling: Ceiling | msgspec.UnsetType = msgspec.UNSET
    user_priority_ceilings: Ceilings | msgspec.UnsetType = msgspec.UNSET
    group_priority_ceilings: Ceilings | msgspec.UnsetType = msgspec.UNSET
    max_kill_grace: Annotated[float, msgspec.Meta(gt=0, le=DAY)] | msgspec.UnsetType = msgspec.UNSET
    retention: Annotated[float, msgspec.Meta(ge=0, le=100 * 365 * DAY)] | msgspec.UnsetType = msgspec.UNSET
    max_history_per_user: Annotated[int, msgspec.Meta(ge=0, le=10_000_000)] | msgspec.UnsetType = msgspec.UNSET
    max_history_bytes_per_user: Annotated[int, msgspec.Meta(ge=0, le=1 << 50)] | msgspec.UnsetType = msgspec.UNSET
    fairshare_half_life: Annotated[float, msgspec.Meta(ge=0, le=10 * 365 * DAY)] | msgspec.UnsetType = msgspec.UNSET
    preemptible_below: Priority | msgspec.UnsetType | None = msgspec.UNSET
    preempt_min_run: Annotated[float, msgspec.Meta(ge=0, le=365 * DAY)] | msgspec.UnsetType = msgspec.UNSET
    preempt_scripts: bool | msgspec.UnsetType = msgspec.UNSET
    stop_signal: Literal["SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP", "SIGALRM", "SIGTERM", "none"] | (
        msgspec.UnsetType) = msgspec.UNSET
    cpu_rank_policy: Literal["batch", "normal"] | msgspec.UnsetType = msgspec.UNSET
    max_connections: Annotated[int, msgspec.Meta(ge=1, le=65536)] | msgspec.UnsetType = msgspec.UNSET
    max_connections_per_user: Annotated[int, msgspec.Meta(ge=1, le=65536)] | msgspec.UnsetType = msgspec.UNSET
    idle_timeout: Timeout | msgspec.UnsetType = msgspec.UNSET
    frame_timeout: Annotated[float, msgspec.Meta(gt=0, le=3600)] | msgspec.UnsetType = msgspec.UNSET
    rank_frames_per_second: Count | msgspec.UnsetType = msgspec.UNSET
    rank_log_max: Annotated[int, msgspec.Meta(ge=64 * 1024, le=1 << 50)] | msgspec.UnsetType = msgspec.UNSET
    allow_root_jobs: bool | msgspec.UnsetType = msgspec.UNSET
    admin_group: Annotated[str, msgspec.Meta(min_length=1, max_length=64)] | msgspec.UnsetType | None = (
        msgspec.UNSET)
    cgroup: Literal["auto", "off"] | msgspec.UnsetType = msgspec.UNSET
    allow_unfenced: bool | msgspec.UnsetType = msgspec.UNSET
    nft_library: Text | msgspec.UnsetType = msgspec.UNSET
    interpreter_check_timeout: Annotated[float, msgspec.Meta(gt=0, le=3600)] | msgspec.UnsetType = msgspec.UNSET
    interpreter_checks_per_user: Annotated[int, msgspec.Meta(ge=1, le=64)] | msgspec.UnsetType = msgspec.UNSET
    gpu_sample_interval: Annotated[float, msgspec.Meta(ge=0.1, le=3600)] | msgspec.UnsetType = msgspec.UNSET
    gpu_idle_after: Annotated[float, msgspec.Meta(gt=0, le=30 * DAY)] | msgspec.UnsetType | None = msgspec.UNSET
    gpu_idle_cancel: bool | msgspec.UnsetType = msgspec.UNSET
    notify: Text | msgspec.UnsetType | None = msgspec.UNSET
    notify_timeout: Annotated[float, msgspec.Meta(ge=1, le=600)] | msgspec.UnsetType = msgspec.UNSET
    notify_url: Annotated[str, msgspec.Meta(min_length=1, max_length=2048, pattern=r"^https?://")] | (
        msgspec.UnsetType) | None = msgspec.UNSET
    defaults: DefaultsSchema | msgspec.UnsetType = msgspec.UNSET


_TOP_KEYS = {f.name for f in dataclasses.fields(Config)} - {"defaults", "config_file"}
_PATHS = ("socket", "state_dir", "metrics_token_file")
_AT = re.compile(r"^(.*?)(?: - at `\$(?:\.(\S+?))?`)?$", re.DOTALL)


def _typed(data: dict[str, Any], where: str) -> ConfigSchema:
    """`data` converted through the schema; a problem is one ConfigError naming the key."""
    try:
        return msgspec.convert(data, ConfigSchema)
    except msgspec.ValidationError as exc:
        match = _AT.match(str(exc))
        problem, key = (match.group(1), match.group(2)) if match else (str(exc), None)
        key = (key or "").replace("[", ".").replace("]", "")
        if problem.startswith("Object contains unknown field"):
            unknown = ".".join(filter(None, (key, problem.split("`")[1])))
            raise ConfigError(f"{where}: unknown key {unknown!r}") from None
        raise ConfigError(f"{where}: {key or '?'}: {problem[0].lower()}{problem[1:]}") from None


def _plain(cfg: Config) -> dict[str, Any]:
    """The config as the file would spell it (paths as strings, tuples as lists)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(Config):
        value = getattr(cfg, f.name)
        if f.name == "config_file":
            continue
        if f.name == "defaults":
            value = dataclasses.asdict(value)
        elif isinstance(value, Path):
            value = str(value)
        elif isinstance(value, tuple):
            value = list(value)
        elif isinstance(value, Mapping):
            value = dict(value)
        out[f.name] = value
    return out


def load_config(path: Path | None, **overrides: Any) -> Config:
    """Read the TOML file (if any) and apply flag overrides; unknown keys and bad values are errors."""
    cfg = Config()
    if path is not None:
        try:
            st = path.stat()
            data = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"config file {path}: {exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path}: {exc}") from None
        cfg = _apply(cfg, data, f"config file {path}")
        cfg = dataclasses.replace(cfg, config_file=path)
        if "metrics_token" in data and st.st_mode & stat.S_IROTH:
            warn_early("config.secret_readable", config_file=str(path), mode=oct(stat.S_IMODE(st.st_mode)),
                       hint="the file holds metrics_token and anyone can read it: chmod o-r, "
                            "or move the token to metrics_token_file (mode 0600)")
    cfg = cfg.with_overrides(**overrides)
    check_config(cfg)
    if cfg.metrics_token_file is not None:
        cfg = dataclasses.replace(cfg, metrics_token=read_secret(cfg.metrics_token_file, "metrics_token_file"))
    return cfg


def read_secret(path: Path, key: str) -> str:
    """The text of a secret file, which must be a regular file of the daemon's user (or root), mode 0600."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"{key}: {path}: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{key}: {path} is not a regular file")
        if st.st_uid not in (0, os.geteuid()):
            raise ConfigError(f"{key}: {path} belongs to uid {st.st_uid}, not to root or the daemon's user")
        if st.st_mode & 0o077:
            raise ConfigError(f"{key}: {path} has mode {oct(stat.S_IMODE(st.st_mode))}; "
                              "a secret file must be readable by its owner only (chmod 600)")
        data = os.read(fd, 4097)
    finally:
        os.close(fd)
    token = data.decode("utf-8", "replace").strip()
    if not token or len(token) > 4096:
        raise ConfigError(f"{key}: {path} must hold one token of 1 to 4096 characters")
    return token


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
    """Every key typed and in range, then the checks across keys (after the file and flags are merged)."""
    _typed(_plain(cfg), "config")
    if cfg.port_range is not None and cfg.port_range[0] > cfg.port_range[1]:
        raise ConfigError(f"port_range: first port {cfg.port_range[0]} is above the last {cfg.port_range[1]}")
    lo, hi = cfg.priority_range
    if lo > hi:
        raise ConfigError(f"priority_range: low end {lo} is above the high end {hi}")
    if cfg.defaults.kill_grace > cfg.max_kill_grace:
        raise ConfigError(f"defaults.kill_grace: {cfg.defaults.kill_grace:g}s is above max_kill_grace "
                          f"({cfg.max_kill_grace:g}s)")
    if cfg.metrics_listen is not None:
        host, _ = parse_listen(cfg.metrics_listen)
        if not is_loopback(host) and not (cfg.metrics_token or cfg.metrics_token_file):
            raise ConfigError(f"metrics_listen {cfg.metrics_listen!r} is not loopback: set metrics_token too")
        if not (cfg.metrics_token or cfg.metrics_token_file or cfg.metrics_public):
            raise ConfigError(f"metrics_listen {cfg.metrics_listen!r} has no metrics_token: every local user could "
                              "read every job's loss, steps and memory; set metrics_token (or metrics_token_file), "
                              "or metrics_public = true to serve it without one")
    try:
        parse_level(str(cfg.log_level))
    except ValueError as exc:
        raise ConfigError(f"log_level: {exc}") from None


def _apply(cfg: Config, data: dict[str, Any], where: str) -> Config:
    if isinstance(data.get("socket_mode"), str):  # "0660": an octal mode spelled as text
        try:
            data = {**data, "socket_mode": int(data["socket_mode"], 8)}
        except ValueError:
            raise ConfigError(f"{where}: socket_mode: {data['socket_mode']!r} is not an octal mode") from None
    typed = _typed(data, where)
    if isinstance(typed.metrics_token, str) and isinstance(typed.metrics_token_file, str):
        raise ConfigError(f"{where}: metrics_token_file: give the token or a token file, not both")
    if isinstance(typed.worker_command, list) and not typed.worker_command:
        raise ConfigError(f"{where}: worker_command: must be a non-empty list of strings")
    kw: dict[str, Any] = {}
    for key in _TOP_KEYS:
        value = getattr(typed, key)
        if value is msgspec.UNSET:
            continue
        if key in _PATHS and value is not None:
            value = Path(value)
        elif isinstance(value, list | tuple):
            value = tuple(value)
        kw[key] = value
    if isinstance(typed.defaults, DefaultsSchema):
        given = data.get("defaults") or {}
        kw["defaults"] = dataclasses.replace(cfg.defaults, **{k: getattr(typed.defaults, k) for k in given})
    return dataclasses.replace(cfg, **kw)
