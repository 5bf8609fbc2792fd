"""A job's timeouts, declared once: the keys, their bounds, their built-in values and their help.

`Timeouts` is one type for three uses. In a job spec each key is None where the daemon's default
applies (that spec's wire and job-file format). The daemon's `[defaults]` table is a `Timeouts` too;
the config fills the keys it leaves out with the built-in values (`Timeouts.builtin`). A job's
resolved timeouts are `spec.over(defaults)`: every key set except `wall`, whose None stays "no
wall-time limit". Consumers read a resolved key through `need`, which gives mypy a `float`.
ddpctl submit's options (flag and help) are made from the same declaration (`Timeouts.keys`).
"""

from __future__ import annotations

import functools
import typing
from typing import Annotated, NamedTuple

import msgspec

WEEK = 7 * 24 * 3600.0
Seconds = Annotated[float, msgspec.Meta(gt=0, le=WEEK)]


class Key(NamedTuple):
    """What a timeout key is besides its type: ddpctl submit's option, the built-in value, the help."""

    flag: str
    builtin: float | None  # None: no limit (wall only)
    help: str


class Timeouts(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """A job's timeouts in seconds; None takes the daemon's default (in `over`'s result: no limit)."""

    join: Annotated[Seconds | None, Key("--join-timeout", 120.0, "Seconds for every rank to join.")] = None
    heartbeat: Annotated[Seconds | None, Key(
        "--heartbeat-timeout", 10.0, "Seconds without any frame from a rank before it counts as hung.")] = None
    progress: Annotated[Seconds | None, Key(
        "--progress-timeout", 600.0, "Seconds without a step before the job counts as hung.")] = None
    wall: Annotated[Seconds | None, Key("--wall-time", None, "Wall-clock limit of the job in seconds.")] = None
    kill_grace: Annotated[Seconds | None, Key("--kill-grace", 5.0, "Seconds between SIGTERM and SIGKILL.")] = None
    stop_warning: Annotated[Seconds | None, Key(
        "--stop-warning", 30.0, "Seconds before the wall time at which ranks are asked to checkpoint and stop.")] = None

    @staticmethod
    @functools.cache
    def keys() -> dict[str, Key]:
        """Each key's flag, built-in value and help, in declaration order."""
        hints = typing.get_type_hints(Timeouts, include_extras=True)
        return {name: typing.get_args(hints[name])[1] for name in Timeouts.__struct_fields__}

    @staticmethod
    def builtin() -> Timeouts:
        """The built-in values: the `[defaults]` table of a config file that gives none."""
        return Timeouts(**{name: key.builtin for name, key in Timeouts.keys().items()})

    def over(self, defaults: Timeouts) -> Timeouts:
        """These timeouts where they are set, `defaults`' elsewhere."""
        return msgspec.structs.replace(defaults, **{name: value for name, value in msgspec.structs.asdict(self).items()
                                                    if value is not None})


def need(seconds: float | None) -> float:
    """A key of resolved timeouts (`over` the config's defaults), which sets every key but `wall`."""
    if seconds is None:
        raise ValueError("a timeout of unresolved timeouts: resolve them with Timeouts.over first")
    return seconds
