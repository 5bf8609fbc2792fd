"""Daemon configuration, declared once: built-in defaults, then the TOML file, then command-line flags.

`Config` is one frozen msgspec struct: each field is a key of the config file with its default,
its type and range (msgspec.Meta), and RESTART where a reload cannot change it (`restart_only`).
The file is converted through it, and the merged result (file and flags) is converted again, so
any problem is one ConfigError whose message names the key. The `[defaults]` table is a job's
timeouts' own type (protocol.timeouts.Timeouts), the one a job spec's timeouts resolve against;
the keys it leaves out take the built-in values.
A metrics token may come from `metrics_token_file`, which must be a regular file owned by the
daemon's user or root and readable by no one else; a config file that holds `metrics_token`
itself and is readable by others is reported with a warning.
"""

from __future__ import annotations

import functools
import ipaddress
import os
import re
import stat
import tomllib
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from ..protocol.paths import daemon_socket_path, daemon_state_dir
from ..protocol.spec import PRIORITY_LIMIT
from ..protocol.timeouts import Timeouts, need
from .logs import warn_early

__all__ = ["RESTART", "Config", "ConfigError", "check_config", "load_config",
           "read_secret", "reloaded", "restart_only"]

DAY = 86400.0


class ConfigError(ValueError):
    pass


class _RestartOnly:
    """The marker of a key bound or opened once at start: a reload keeps its old value (`reloaded`)."""

    def __repr__(self) -> str:
        return "RESTART"


RESTART = _RestartOnly()

Text = Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
Priority = Annotated[int, msgspec.Meta(gt=-PRIORITY_LIMIT, lt=PRIORITY_LIMIT)]
Count = Annotated[int, msgspec.Meta(ge=1, le=10_000_000)]
Ceiling = Annotated[int, msgspec.Meta(ge=0, lt=PRIORITY_LIMIT)]
Ceilings = Annotated[dict[Name, Ceiling], msgspec.Meta(max_length=10_000)]
Timeout = Annotated[float, msgspec.Meta(gt=0, le=7 * DAY)]
Connections = Annotated[int, msgspec.Meta(ge=1, le=65536)]
PoolCount = Annotated[int, msgspec.Meta(ge=0, le=1024), RESTART]
LogLevel = Literal["debug", "info", "warning", "error", "DEBUG", "INFO", "WARNING", "ERROR"]
StopSignal = Literal["SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP", "SIGALRM", "SIGTERM", "none"]


def _cpu_count() -> int:
    return os.cpu_count() or 1


class Config(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Every key of the config file: its default, type and range, and RESTART where a reload cannot change it."""

    socket: Annotated[Path, RESTART] = msgspec.field(default_factory=daemon_socket_path)
    state_dir: Annotated[Path, RESTART] = msgspec.field(default_factory=daemon_state_dir)
    socket_mode: Annotated[int, msgspec.Meta(ge=0, le=0o777), RESTART] = 0o660
    socket_group: Annotated[Name | None, RESTART] = None
    store_host: Annotated[str, msgspec.Meta(min_length=1, max_length=255)] = "127.0.0.1"
    port_range: tuple[Port, Port] | None = None  # None: an ephemeral port per attempt
    heartbeat_interval: Annotated[float, msgspec.Meta(gt=0, le=60)] = 1.0
    cpu_slots: Annotated[int, msgspec.Meta(ge=1, le=1 << 16)] = msgspec.field(default_factory=_cpu_count)
    gpus: Annotated[Annotated[int, msgspec.Meta(ge=0, le=1024)] | None, RESTART] = None  # None: ask at start
    pool_size: PoolCount = 4  # warm interpreters in all (0: none); see docs/pool.md for the memory each holds
    pool_per_key: PoolCount = 4  # per (user, interpreter, start-up environment): 2 jobs' worth of a 2-rank job
    # one fork server per key forks every pooled rank; false: whole warm interpreters (docs/pool.md)
    pool_fork_server: Annotated[bool, RESTART] = True
    # seconds a key stays warm after its last job started
    pool_idle_expiry: Annotated[float, msgspec.Meta(gt=0, le=30 * DAY), RESTART] = 600.0
    # seconds a pool member may take to be ready (torch imported), not counting while jobs hold cores
    pool_start_timeout: Annotated[float, msgspec.Meta(gt=0, le=DAY), RESTART] = 300.0
    # seconds from its spawn a fork server still starting may hold a job's ranks (0: they start cold beside it)
    pool_server_wait: Annotated[float, msgspec.Meta(ge=0, le=DAY), RESTART] = 10.0
    # argv prefix of a worker; () is `sys.executable -m ddpd.worker`
    worker_command: Annotated[tuple[Text, ...], msgspec.Meta(max_length=64)] = ()
    max_running: Annotated[int, msgspec.Meta(ge=1, le=100_000)] = 64
    log_level: LogLevel = "info"
    log_format: Annotated[Literal["auto", "json", "console", "human", "journald"], RESTART] = "auto"
    # "HOST:PORT" of the Prometheus endpoint; None: off
    metrics_listen: Annotated[Annotated[str, msgspec.Meta(min_length=1, max_length=300)] | None, RESTART] = None
    metrics_token: Annotated[Text | None, RESTART] = None  # bearer token the endpoint requires (off loopback)
    metrics_token_file: Path | None = None  # a 0600 file holding the token instead
    metrics_public: Annotated[bool, RESTART] = False  # serve without a token (every local user sees every job)
    # limits (issue: nothing a client or a job sends is unbounded)
    max_queued: Count = 10_000  # jobs waiting in the queue, all users together
    max_queued_per_user: Count = 1_000
    # GPUs one user's running jobs may hold together; None: no limit
    max_gpus_per_user: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)] | None = None
    priority_range: tuple[Priority, Priority] = (-1000, 1000)  # the band a job's priority must lie in
    # priority above the default (0) is the operator's to grant (docs/usage.md, "Sharing the box"): the
    # highest a user may ask for is the greatest of priority_ceiling, its own entry and its groups'
    # entries; root, the daemon's own user and admin_group members are bounded by priority_range alone
    priority_ceiling: Ceiling = 0
    user_priority_ceilings: Ceilings = msgspec.field(default_factory=dict)  # user name -> ceiling
    group_priority_ceilings: Ceilings = msgspec.field(default_factory=dict)  # group name -> ceiling of members
    # a job's kill_grace at most (keep under the unit's TimeoutStopSec)
    max_kill_grace: Annotated[float, msgspec.Meta(gt=0, le=DAY)] = 60.0
    # fair share and preemption (docs/usage.md, "Sharing the box")
    # seconds for a user's recorded usage to halve; 0: no decay
    fairshare_half_life: Annotated[float, msgspec.Meta(ge=0, le=10 * 365 * DAY)] = 7 * DAY
    preemptible_below: Priority | None = None  # a job of priority below this is preemptible as if --preemptible
    # seconds a job runs before it may be preempted (again)
    preempt_min_run: Annotated[float, msgspec.Meta(ge=0, le=365 * DAY)] = 300.0
    preempt_scripts: bool = False  # preempt scripts that never call the stop API (ddpd.worker.api.should_stop)
    stop_signal: StopSignal = "SIGUSR1"  # raised in a script rank that handles it when asked to stop; "none": never
    # the scheduling policy of a CPU job's ranks (docs/operations.md): "batch" (SCHED_BATCH: their
    # threads' wake-ups never preempt each other, the ranks' gloo threads no longer interrupt the
    # training thread hundreds of times a second) or "normal" (SCHED_OTHER); GPU jobs stay normal
    cpu_rank_policy: Literal["batch", "normal"] = "batch"
    # seconds an ended job (row, events, logs, checkpoints) is kept; 0: forever
    retention: Annotated[float, msgspec.Meta(ge=0, le=100 * 365 * DAY)] = 30 * DAY
    # one user's history (docs/operations.md, "Limits and retention"): past either bound, that user's
    # oldest ended jobs are retired (as `rm` does), never another user's; 0: no bound
    max_history_per_user: Annotated[int, msgspec.Meta(ge=0, le=10_000_000)] = 1_000  # ended jobs of one uid
    # bytes of the database they take (spec, events, ranks)
    max_history_bytes_per_user: Annotated[int, msgspec.Meta(ge=0, le=1 << 50)] = 64 * 1024 * 1024
    max_connections: Connections = 256  # control connections open at once
    max_connections_per_user: Connections = 32  # of them one uid may hold (root, admin group: a reserve too)
    idle_timeout: Timeout = 600.0  # a control connection with no complete request for this long is closed
    # a request frame must be complete within this many seconds of its first byte
    frame_timeout: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 10.0
    rank_frames_per_second: Count = 2_000  # frames a rank may send per second (averaged); a flood fails the job
    # bytes of a rank log before it rotates (the newest part is kept)
    rank_log_max: Annotated[int, msgspec.Meta(ge=64 * 1024, le=1 << 50)] = 256 * 1024 * 1024
    # identity and containment (docs/identity.md)
    allow_root_jobs: bool = False  # a root daemon refuses jobs of uid 0 unless this is set
    admin_group: Name | None = None  # members see every job's detail, as root does
    # auto: one cgroup per attempt where cgroup v2 is writable; off: process groups only
    cgroup: Annotated[Literal["auto", "off"], RESTART] = "auto"
    # port fences (docs/identity.md): without one, a multi-node job's store and endpoint are open to
    # every local user, so such a job is refused unless this is set
    allow_unfenced: bool = False
    nft_library: Annotated[Text, RESTART] = "libnftables.so.1"  # the library the fences go through (path or name)
    # seconds the submit-time `import torch, ddpd.worker` may take
    interpreter_check_timeout: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 60.0
    interpreter_checks_per_user: Annotated[int, msgspec.Meta(ge=1, le=64)] = 2  # of those one user runs at once
    # seconds between samples of each GPU's utilisation (NVML)
    gpu_sample_interval: Annotated[float, msgspec.Meta(ge=0.1, le=3600)] = 10.0
    # a job whose GPUs stay at 0% this long is warned; None: never
    gpu_idle_after: Annotated[float, msgspec.Meta(gt=0, le=30 * DAY)] | None = 3600.0
    gpu_idle_cancel: bool = False  # ... and cancelled (reason gpu_idle)
    notify: Text | None = None  # a command run (as the submitter) when any job ends, restarts or is preempted
    # or a URL that gets the same as a JSON POST
    notify_url: Annotated[str, msgspec.Meta(min_length=1, max_length=2048, pattern=r"^https?://")] | None = None
    # seconds one run of a notification hook may take (then killed; retried once)
    notify_timeout: Annotated[float, msgspec.Meta(ge=1, le=600)] = 30.0
    defaults: Timeouts = msgspec.field(default_factory=Timeouts.builtin)  # the [defaults] table
    config_file: Path | None = None  # the file read (set by load_config, never a key of the file)

    def __post_init__(self) -> None:
        # a [defaults] table that gives some keys: the others are the built-in values, never None
        msgspec.structs.force_setattr(self, "defaults", self.defaults.over(Timeouts.builtin()))

    def with_overrides(self, **kw: Any) -> Config:
        return msgspec.structs.replace(self, **{k: v for k, v in kw.items() if v is not None})


@functools.cache
def restart_only() -> tuple[str, ...]:
    """The keys marked RESTART: a reload cannot change them (they are bound or opened once at start)."""
    hints = typing.get_type_hints(Config, include_extras=True)
    return tuple(key for key in Config.__struct_fields__
                 if typing.get_origin(hints[key]) is Annotated and RESTART in typing.get_args(hints[key])[1:])


def reloaded(old: Config, new: Config) -> tuple[Config, list[str], list[str]]:
    """The config a reload applies (`new`, with the restart-only keys kept from `old`), the keys it
    changes, and the restart-only keys whose new value waits for a restart."""
    ignored = [key for key in restart_only() if getattr(new, key) != getattr(old, key)]
    new = msgspec.structs.replace(new, **{key: getattr(old, key) for key in restart_only()})
    changed = sorted(key for key in Config.__struct_fields__ if getattr(new, key) != getattr(old, key))
    return new, changed, ignored


# -- reading: the file and the flags, converted through Config -------------------------------------

_NOT_KEYS = ("config_file",)
_AT = re.compile(r"^(.*?)(?: - at `\$(?:\.(\S+?))?`)?$", re.DOTALL)


def _decode_path(kind: type, value: Any) -> Any:
    if kind is Path:
        if not isinstance(value, str) or not 1 <= len(value) <= 4096:
            raise ValueError("expected a path of 1 to 4096 characters")
        return Path(value)
    raise NotImplementedError


def _typed(data: dict[str, Any], where: str) -> Config:
    """`data` converted through Config; a problem is one ConfigError naming the key."""
    for key in _NOT_KEYS:
        if key in data:
            raise ConfigError(f"{where}: unknown key {key!r}")
    try:
        return msgspec.convert(data, Config, dec_hook=_decode_path)
    except msgspec.ValidationError as exc:
        match = _AT.match(str(exc))
        problem, at = (match.group(1), match.group(2)) if match else (str(exc), None)
        key = (at or "").replace("[...]", " (an entry)").replace("[", ".").replace("]", "")
        if problem.startswith("Object contains unknown field"):
            unknown = ".".join(filter(None, (key, problem.split("`")[1])))
            raise ConfigError(f"{where}: unknown key {unknown!r}") from None
        raise ConfigError(f"{where}: {key or '?'}: {problem[0].lower()}{problem[1:]}") from None


def _plain(cfg: Config) -> dict[str, Any]:
    """The config as the file would spell it (paths as strings, tuples as lists)."""
    out: dict[str, Any] = msgspec.to_builtins(cfg, enc_hook=str)
    for key in _NOT_KEYS:
        out.pop(key, None)
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
        cfg = msgspec.structs.replace(_apply(data, f"config file {path}"), config_file=path)
        if "metrics_token" in data and st.st_mode & stat.S_IROTH:
            warn_early("config.secret_readable", config_file=str(path), mode=oct(stat.S_IMODE(st.st_mode)),
                       hint="the file holds metrics_token and anyone can read it: chmod o-r, "
                            "or move the token to metrics_token_file (mode 0600)")
    cfg = cfg.with_overrides(**overrides)
    check_config(cfg)
    if cfg.metrics_token_file is not None:
        cfg = msgspec.structs.replace(cfg, metrics_token=read_secret(cfg.metrics_token_file, "metrics_token_file"))
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
    if (grace := need(cfg.defaults.kill_grace)) > cfg.max_kill_grace:
        raise ConfigError(f"defaults.kill_grace: {grace:g}s is above max_kill_grace "
                          f"({cfg.max_kill_grace:g}s)")
    if cfg.metrics_listen is not None:
        host, _ = parse_listen(cfg.metrics_listen)
        if not is_loopback(host) and not (cfg.metrics_token or cfg.metrics_token_file):
            raise ConfigError(f"metrics_listen {cfg.metrics_listen!r} is not loopback: set metrics_token too")
        if not (cfg.metrics_token or cfg.metrics_token_file or cfg.metrics_public):
            raise ConfigError(f"metrics_listen {cfg.metrics_listen!r} has no metrics_token: every local user could "
                              "read every job's loss, steps and memory; set metrics_token (or metrics_token_file), "
                              "or metrics_public = true to serve it without one")


def _apply(data: dict[str, Any], where: str) -> Config:
    if isinstance(data.get("socket_mode"), str):  # "0660": an octal mode spelled as text
        try:
            data = {**data, "socket_mode": int(data["socket_mode"], 8)}
        except ValueError:
            raise ConfigError(f"{where}: socket_mode: {data['socket_mode']!r} is not an octal mode") from None
    if "metrics_token" in data and "metrics_token_file" in data:
        raise ConfigError(f"{where}: metrics_token_file: give the token or a token file, not both")
    if data.get("worker_command") == []:
        raise ConfigError(f"{where}: worker_command: must be a non-empty list of strings")
    return _typed(data, where)
