"""Entry point: ``python -m ddpd.worker --fd N --parent PID [--pool]``."""

from __future__ import annotations

from .bootstrap import main

if __name__ == "__main__":
    main()
