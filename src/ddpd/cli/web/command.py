"""`ddpctl web`: the click command. Its server's imports (Starlette, hypercorn) wait until it runs,
so the other commands start as fast without them, and a ddpctl without the extra `web` says so."""

from __future__ import annotations

import math
from pathlib import Path

import click

from ..group import EXIT_FAILED, cli, socket_of, socket_option
from ..output import error


@cli.command()
@click.option("--port", type=click.IntRange(0, 65535), default=0, show_default=True,
              help="Port on 127.0.0.1 (0: a free one).")
@click.option("--open", "open_browser", is_flag=True, help="Open the URL in a browser as well.")
@click.option("--refresh", type=click.FloatRange(min=0), default=1.0, show_default=True,
              help="Seconds between a page's refreshes when no event comes (ages, heartbeats); 0: on events only.")
@socket_option
def web(port: int, open_browser: bool, refresh: float, socket_path: Path | None) -> None:
    """Serve a live web view of the jobs, one job and the daemon on 127.0.0.1.

    It prints one URL carrying a random token; nothing is served without it. It reads everything
    through the daemon's socket as you, so it shows what `ddpctl` shows you. Ctrl-C stops it.
    """
    try:
        import anyio

        from .server import PortTaken, run
    except ImportError as exc:
        error(f"ddpctl web needs the extra 'web': pip install 'ddpd[web]' ({exc})")
        raise SystemExit(EXIT_FAILED) from None
    try:
        anyio.run(run, socket_of(socket_path), port, open_browser, refresh or math.inf)
    except PortTaken as exc:
        error(str(exc))
        raise SystemExit(EXIT_FAILED) from None
