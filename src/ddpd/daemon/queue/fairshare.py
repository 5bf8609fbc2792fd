"""Fair share: each user's recent usage (GPU-seconds and CPU-slot-seconds, decaying with a half-life).

A running job charges its owner for the GPUs and CPU slots it holds (`Resources.need`) for as long as
it holds them; usage decays by half every `half_life` seconds, as Slurm's fair-share usage does. The
scheduler charges at each decision and when a job lets its resources go, and saves the users charged
through the journal (table `usage`): at a job's end, at shutdown, and every SAVE_EVERY seconds of
decisions between, so usage outlives a daemon restart; what running jobs used since the last save is
lost if the daemon dies.

`Usage` and its arithmetic are pure; `FairShare` holds the users' usage and what each running job
was last charged up to.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass

from ...protocol.control import ShareView
from ..store.journal import Journal
from ..store.records import Job
from .live import LiveConfig
from .resources import Resources


@dataclass(frozen=True)
class Usage:
    """A user's usage as of `at` (wall-clock seconds)."""

    gpu_seconds: float = 0.0
    cpu_seconds: float = 0.0
    at: float = 0.0

    @property
    def total(self) -> float:
        """One number to compare users by: a GPU-second and a CPU-slot-second weigh the same."""
        return self.gpu_seconds + self.cpu_seconds

    def decayed(self, now: float, half_life: float) -> Usage:
        """This usage as of `now` (never forward in time past `now`; no decay for a clock gone back)."""
        if now <= self.at or half_life <= 0:
            return Usage(self.gpu_seconds, self.cpu_seconds, max(now, self.at))
        keep = 0.5 ** ((now - self.at) / half_life)
        return Usage(self.gpu_seconds * keep, self.cpu_seconds * keep, now)

    def plus(self, gpus: float, cpus: int, seconds: float, now: float, half_life: float) -> Usage:
        """Decayed to `now`, then `seconds` of holding `gpus` GPUs and `cpus` CPU slots added."""
        base = self.decayed(now, half_life)
        return Usage(base.gpu_seconds + gpus * seconds, base.cpu_seconds + cpus * seconds, base.at)


SHARE_USERS = 2000  # users in a `share` reply at most
SAVE_EVERY = 30.0  # seconds between saves of the running jobs' charges (a job's end is saved at once)


class FairShare:
    """Every user's usage; charges running jobs and saves what changed through the journal."""

    def __init__(self, journal: Journal, live: LiveConfig) -> None:
        self.journal = journal
        self.live = live  # the daemon's current config (its `fairshare_half_life`: read at each use)
        self.usage: dict[int, Usage] = {}
        self._charged: dict[str, float] = {}  # running job id -> charged up to (wall clock)
        self._unsaved: set[int] = set()  # users charged since their usage was last saved
        self._saved_at = float("-inf")

    @property
    def half_life(self) -> float:
        """Seconds for usage to decay by half, as the current config says (a reload changes it)."""
        return self.live.current.fairshare_half_life

    async def load(self) -> None:
        self.usage = {uid: Usage(*row) for uid, row in (await self.journal.load_usage()).items()}

    def start(self, job: Job, now: float) -> None:
        """A job took its resources at `now`: charged from then on."""
        self._charged[job.id] = now

    def charge(self, running: Iterable[Job], now: float) -> set[int]:
        """Charge each running job's owner up to `now`; the users charged."""
        users: set[int] = set()
        for job in running:
            since = self._charged.get(job.id)
            if since is None:
                continue
            gpus, cpus = Resources.need(job.spec)
            old = self.usage.get(job.owner_uid, Usage(at=now))
            self.usage[job.owner_uid] = old.plus(gpus, cpus, max(0.0, now - since), now, self.half_life)
            self._charged[job.id] = now
            users.add(job.owner_uid)
        self._unsaved |= users
        return users

    def due(self, now: float) -> set[int]:
        """The users to save now: those charged since the last save, once every SAVE_EVERY seconds."""
        if now - self._saved_at < SAVE_EVERY:
            return set()
        self._saved_at, users, self._unsaved = now, self._unsaved, set()
        return users

    def stop(self, job: Job, now: float) -> set[int]:
        """A job let its resources go: its last charge; the users charged."""
        users = self.charge([job], now)
        self._charged.pop(job.id, None)
        return users

    def now(self, now: float) -> dict[int, Usage]:
        """Each user's usage decayed to `now`."""
        return {uid: u.decayed(now, self.half_life) for uid, u in self.usage.items()}

    async def save(self, users: Iterable[int]) -> None:
        """Record these users' usage (a write that fails is logged by the journal, never raised)."""
        rows = {uid: (u.gpu_seconds, u.cpu_seconds, u.at) for uid in users if (u := self.usage.get(uid))}
        if rows:
            await self.journal.save_usage(rows)


def share_views(usage: Mapping[int, Usage], factors: Mapping[int, float], jobs: Iterable[Job],
                running: Set[str]) -> list[ShareView]:
    """The `share` table: every user with usage or unended jobs, the highest factor (next served) first;
    at most SHARE_USERS of them (a reply stays one frame however many users ever ran a job)."""
    counts: dict[int, list[int]] = {}
    for job in jobs:
        if not job.state.final:
            counts.setdefault(job.owner_uid, [0, 0])[0 if job.id in running else 1] += 1
    total = sum(u.total for u in usage.values())
    views = []
    for uid in sorted(set(usage) | set(counts) | set(factors)):
        u = usage.get(uid, Usage())
        n_running, n_queued = counts.get(uid, [0, 0])
        part = round(u.total / total, 4) if total else 0.0
        views.append(ShareView(uid=uid, gpu_seconds=round(u.gpu_seconds, 3), cpu_seconds=round(u.cpu_seconds, 3),
                               usage=part, factor=round(factors.get(uid, 1.0), 4), running=n_running,
                               queued=n_queued))
    return sorted(views, key=lambda v: (-v.factor, v.uid))[:SHARE_USERS]
