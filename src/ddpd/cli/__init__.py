"""ddpctl, the command line of ddpd: `group` (the click group), `commands`, `observe` and `admin`
(its commands), `specs` and `jobfile` (submit's options, job files and the JobSpec they build),
`render` (tables and lines), `output` (stdout and stderr), `watch`, `curves`, `completion`."""

from __future__ import annotations

from .commands import cli, main

__all__ = ["cli", "main"]
