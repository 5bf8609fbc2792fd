"""Which jobs a bulk command (`cancel --state/--mine/--name`) selects: every filter given must hold."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ddpd.client import JobView


@dataclass(frozen=True)
class Selection:
    states: set[str] = field(default_factory=set)  # job states, upper case (empty: any)
    mine: bool = False  # only the caller's jobs
    names: set[str] = field(default_factory=set)  # job names (empty: any)

    def any(self) -> bool:
        """Whether any filter was given."""
        return bool(self.states or self.mine or self.names)

    def takes(self, view: JobView) -> bool:
        return ((not self.states or str(view.state) in self.states)
                and (not self.mine or view.owner_uid == os.getuid())
                and (not self.names or view.name in self.names))
