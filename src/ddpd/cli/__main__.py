"""`python -m ddpd.cli`: ddpctl."""

from __future__ import annotations

from .commands import main

main()
