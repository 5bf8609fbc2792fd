"""`ddpd`: the daemon's command line (`ddpd serve`, `ddpd health`)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from ..protocol import MAX_FRAME, Decoder, FrameError, encode
from ..protocol.control import Ok, Ping, Reply
from ..protocol.paths import UnsafeSocketDir, client_socket_path
from .config import ConfigError, load_config
from .store.errors import StorageError

EX_CONFIG = 78  # sysexits.h: configuration error; the unit does not restart on it


def _port_range(value: str | None) -> tuple[int, int] | None:
    if value is None:
        return None
    try:
        first, _, last = value.partition("-")
        lo, hi = int(first), int(last or first)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not PORT or FIRST-LAST") from None
    if not 0 < lo <= hi < 65536:
        raise click.BadParameter(f"{value!r} is not within 1-65535")
    return lo, hi


@click.group()
@click.version_option(package_name="ddpd")
def main() -> None:
    """ddpd: launch and supervise PyTorch DDP jobs."""


@main.command()
@click.option("--socket", "socket_path", type=click.Path(path_type=Path), help="control socket path")
@click.option("--state-dir", type=click.Path(path_type=Path), help="jobs, logs and the SQLite database")
@click.option("--config", "config_file", type=click.Path(path_type=Path), envvar="DDPD_CONFIG",
              help="TOML config file")
@click.option("--port-range", help="rendezvous ports, FIRST-LAST (default: ephemeral)")
@click.option("--store-host", help="address the rendezvous store binds (default 127.0.0.1)")
@click.option("--gpus", type=int, help="number of GPUs to schedule (default: what torch finds)")
@click.option("--cpu-slots", type=int, help="CPU ranks that may run at once (default: cores)")
@click.option("--heartbeat-interval", type=float, help="seconds between worker heartbeats")
@click.option("--pool-size", type=click.IntRange(min=0),
              help="warm pre-started workers to keep in all (default 4; 0: none)")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]))
@click.option("--log-format", type=click.Choice(["auto", "json", "console", "human", "journald"]),
              help="auto: journald when stderr is the journal, one line per job state change (human) on a "
                   "terminal, else JSON lines; console: every event, readable")
@click.option("--metrics-listen", metavar="HOST:PORT",
              help="serve Prometheus metrics at http://HOST:PORT/metrics (default: off)")
@click.option("--allow-root-jobs", is_flag=True, default=None,
              help="accept jobs of uid 0 (a root daemon refuses them by default)")
@click.option("--cgroup", type=click.Choice(["auto", "off"]),
              help="auto: one cgroup per attempt where cgroup v2 is writable (default); off: process groups only")
def serve(socket_path: Path | None, state_dir: Path | None, config_file: Path | None, port_range: str | None,
          store_host: str | None, gpus: int | None, cpu_slots: int | None, heartbeat_interval: float | None,
          pool_size: int | None, log_level: str | None, log_format: str | None, metrics_listen: str | None,
          allow_root_jobs: bool | None, cgroup: str | None) -> None:
    """Run the daemon in the foreground (under systemd: Type=notify, socket activation)."""
    from .app import run

    overrides = {
        "socket": socket_path.absolute() if socket_path else None,
        "state_dir": state_dir.absolute() if state_dir else None,
        "port_range": _port_range(port_range),
        "store_host": store_host,
        "gpus": gpus,
        "cpu_slots": cpu_slots,
        "heartbeat_interval": heartbeat_interval,
        "pool_size": pool_size,
        "log_level": log_level,
        "log_format": log_format,
        "metrics_listen": metrics_listen,
        "allow_root_jobs": allow_root_jobs,
        "cgroup": cgroup,
    }
    try:
        config = load_config(config_file, **overrides)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    try:
        run(config, overrides)
    except StorageError as exc:  # an unusable state directory: a restart would not help
        click.echo(f"ddpd: error: {exc.message}", err=True)
        sys.exit(EX_CONFIG)
    except OSError as exc:
        click.echo(f"ddpd: error: {exc}", err=True)
        sys.exit(1)


@main.command()
@click.option("--socket", "socket_path", type=click.Path(path_type=Path), envvar="DDPD_SOCKET")
@click.option("--timeout", type=float, default=5.0, show_default=True, help="seconds to wait for the answer")
def health(socket_path: Path | None, timeout: float) -> None:
    """Exit 0 when the daemon answers a ping, 1 otherwise (for probes)."""
    import socket as _socket

    try:
        path = socket_path or client_socket_path()
    except UnsafeSocketDir as exc:
        click.echo(f"unhealthy: {exc}", err=True)
        sys.exit(1)
    try:
        with _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(str(path))
            sock.sendall(encode(Ping(id=1)))
            line = sock.makefile("rb").readline(MAX_FRAME + 1)
    except OSError as exc:
        click.echo(f"unhealthy: {path}: {exc}", err=True)
        sys.exit(1)
    try:
        reply: Reply | None = Decoder[Reply](Reply).decode_frame(line.rstrip(b"\n"))
    except FrameError:
        reply = None
    if not (isinstance(reply, Ok) and reply.result == "pong"):
        click.echo(f"unhealthy: unexpected reply {line[:200]!r}", err=True)
        sys.exit(1)
    click.echo("ok")
