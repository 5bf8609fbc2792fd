"""`python -m ddpd.daemon`: the same as the `ddpd` command."""

from __future__ import annotations

from .main import main

main()
