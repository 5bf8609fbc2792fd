"""A job's timeouts, declared once: the keys, their bounds and the daemon's built-in values.

`JobTimeouts` is every timeout set: the daemon's `[defaults]` table (its field defaults are the
built-in values) and a job's resolved timeouts (`JobTimeouts.resolve`), what the scheduler, the
attempt's deadlines and teardown, and the ranks' collective timeout read. `Timeouts` is the part
a job spec asks for: the same keys with the same bounds, each None where the daemon's default
applies. The submit options of ddpctl are made from `Timeouts`' fields (cli/specs.py).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

WEEK = 7 * 24 * 3600.0
Seconds = Annotated[float, msgspec.Meta(gt=0, le=WEEK)]


class Timeouts(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Per-job timeouts in seconds; None takes the daemon's default."""

    join: Seconds | None = None  # for every rank to join
    heartbeat: Seconds | None = None  # without any frame from a rank before it counts as hung
    progress: Seconds | None = None  # without a step before the job counts as hung
    wall: Seconds | None = None  # wall-clock limit of the job
    kill_grace: Seconds | None = None  # between SIGTERM and SIGKILL
    stop_warning: Seconds | None = None  # before the wall time at which ranks are asked to stop


class JobTimeouts(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Every timeout, in seconds (wall None: no wall-time limit); the defaults are the built-in values."""

    join: Seconds = 120.0
    heartbeat: Seconds = 10.0
    progress: Seconds = 600.0
    wall: Seconds | None = None
    kill_grace: Seconds = 5.0
    stop_warning: Seconds = 30.0

    def resolve(self, spec: Timeouts) -> JobTimeouts:
        """A job's timeouts: its spec's where it sets them, these elsewhere."""
        return JobTimeouts(join=spec.join or self.join, heartbeat=spec.heartbeat or self.heartbeat,
                           progress=spec.progress or self.progress, wall=spec.wall or self.wall,
                           kill_grace=spec.kill_grace or self.kill_grace,
                           stop_warning=spec.stop_warning or self.stop_warning)
