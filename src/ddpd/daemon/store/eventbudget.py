"""How much of what one rank causes is kept in the database: rate- and size-bounded events.

The events a rank may cause again and again (its join phases again, a `rank.rejoined` each; its
checkpoints, a `job.checkpointed` each, with the path it named; its log rotations, a
`rank.log_rotated` each when it writes without end) are bounded per rank, so a rank cannot grow
the root daemon's database without bound (events are kept for the whole retention):

- re-joins are coalesced: the first REJOINS_KEPT are persisted, then only each power of two (the
  count is in the event); the others go to live followers only;
- every persisted event of this kind takes a token of `EventBudget` (BURST at once, RATE a second
  after that, at most CAP per rank and attempt); beyond it the event is live only, and the first
  such event is persisted once as `rank.events_limited`, naming the limit; the last event held
  back is persisted when the rank's channel ends (`held_back: true`), so the record's latest
  checkpoint is the rank's latest;
- a checkpoint's path is clipped to PATH_CLIP characters.

Pure: the caller passes the time.
"""

from __future__ import annotations

from dataclasses import dataclass

RATE = 0.5  # persisted events a second, per rank, after the burst
BURST = 200.0
CAP = 5_000  # persisted events per rank and attempt, in all
REJOINS_KEPT = 8
PATH_CLIP = 512  # characters of a checkpoint path kept in its event


def rejoin_kept(count: int) -> bool:
    """Whether the `count`-th re-join of a rank is persisted (the first few, then powers of two)."""
    return count <= REJOINS_KEPT or count & (count - 1) == 0


@dataclass
class EventBudget:
    """A token bucket and a cap over one rank's persisted events; `limited` once it refused."""

    tokens: float = BURST
    last: float | None = None
    kept: int = 0
    dropped: int = 0

    def admit(self, now: float) -> bool:
        """Whether one more event of the rank is persisted now (else it goes live only)."""
        if self.last is not None:
            self.tokens = min(BURST, self.tokens + (now - self.last) * RATE)
        self.last = now
        if self.tokens < 1.0 or self.kept >= CAP:
            self.dropped += 1
            return False
        self.tokens -= 1.0
        self.kept += 1
        return True

    @property
    def first_refusal(self) -> bool:
        """True right after the first refused event (the moment to record that the limit bit)."""
        return self.dropped == 1

    def describe(self) -> str:
        return (f"events of this rank beyond {BURST:.0f} at once, {RATE:g} a second or {CAP} in all are "
                "shown to live followers only, not kept")
