"""ddpctl, the command line of ddpd: `commands` (the click group), `specs` (submit's options and
the JobSpec they build), `render` (tables and lines), `output` (stdout and stderr), `watch`."""

from __future__ import annotations

from .commands import cli, main

__all__ = ["cli", "main"]
