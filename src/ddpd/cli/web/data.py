"""What the pages ask the daemon, through the async client, as the user who runs `ddpctl web`.

The jobs page's filters (state, owner) are applied here over the daemon's pages (`list`, newest
first): without a filter one page of the daemon is one page of the view; with one, daemon pages
(the view's size, then twice as large each time, up to the daemon's limit) are read until a view
page is full or `SCAN_LIMIT` jobs were looked at, and the cursor says where the next view page
starts (a view page may hold a few more rows than asked for, never a job twice).

Query values come from the URL: each is checked, and a bad one is a `BadQuery` naming it.
"""

from __future__ import annotations

import os
import pwd
import re
from dataclasses import dataclass, field

from ddpd.client import MAX_WORLD, AsyncClient, CurveResult, DaemonInfo, JobState, JobView, RemoteError

PAGE_SIZE = 50  # rows of the jobs page
MAX_PAGE = 500  # the daemon's own page limit
SCAN_LIMIT = 5000  # jobs looked at for one filtered page at most
INT64_MAX = 2**63 - 1
MAX_RANK = MAX_WORLD - 1  # the protocol's bound on a global rank, less one (the daemon checks it again)
_USER = re.compile(r"^[A-Za-z0-9_.][A-Za-z0-9_.-]{0,31}\$?$")
_JOB_ID = re.compile(r"^[\x21-\x7e]{1,64}$")
ACTIVE = frozenset(s.value for s in JobState if not s.final)


class BadQuery(ValueError):
    """A query value of the URL that cannot be used; its message names it."""


@dataclass(frozen=True)
class JobFilter:
    state: str | None = None
    uid: int | None = None
    user: str | None = None  # as given, for the page's form
    before: int | None = None
    limit: int = PAGE_SIZE

    def matches(self, job: JobView) -> bool:
        return (self.state is None or job.state == self.state) and (self.uid is None or job.owner_uid == self.uid)

    @property
    def filtered(self) -> bool:
        return self.state is not None or self.uid is not None


def _int(name: str, text: str, low: int, high: int) -> int:
    if not text.isdigit() or len(text) > 19 or not low <= int(text) <= high:
        raise BadQuery(f"{name} must be a whole number from {low} to {high}, not {text[:40]!r}")
    return int(text)


def uid_of(user: str) -> int:
    """A user name or uid as a uid; BadQuery for an unknown name."""
    if user.isdigit():
        return _int("user", user, 0, 2**32 - 1)
    if not _USER.match(user):
        raise BadQuery(f"user {user[:40]!r} is not a user name")
    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        raise BadQuery(f"no user named {user!r}") from None


def job_filter(query: dict[str, str]) -> JobFilter:
    state = query.get("state") or None
    if state is not None and state not in JobState.__members__:
        raise BadQuery(f"state must be one of {', '.join(JobState.__members__)}, not {state[:40]!r}")
    user = query.get("user") or None
    before = query.get("before") or None
    limit = query.get("limit") or None
    return JobFilter(state=state, user=user, uid=None if user is None else uid_of(user),
                     before=None if before is None else _int("before", before, 0, INT64_MAX),
                     limit=PAGE_SIZE if limit is None else _int("limit", limit, 1, MAX_PAGE))


def rank_of(text: str) -> int:
    return _int("rank", text, 0, MAX_RANK)


def check_job_id(job_id: str) -> str:
    if not _JOB_ID.match(job_id):
        raise BadQuery("a job id is 1 to 64 printable characters")
    return job_id


@dataclass
class JobsPage:
    jobs: list[JobView]
    next: int | None
    scanned: int = 0


async def jobs_page(client: AsyncClient, flt: JobFilter) -> JobsPage:
    """One page of the jobs view, newest first, and the cursor of the next (None: the last)."""
    if not flt.filtered:
        page = await client.list_page(all=True, limit=flt.limit, before=flt.before)
        return JobsPage(page.jobs, page.next, len(page.jobs))
    active_only = flt.state in ACTIVE
    found: list[JobView] = []
    cursor, scanned, size = flt.before, 0, flt.limit
    while len(found) < flt.limit and scanned < SCAN_LIMIT:
        page = await client.list_page(all=not active_only, limit=size, before=cursor)
        found.extend(job for job in page.jobs if flt.matches(job))
        scanned += len(page.jobs)
        cursor = page.next
        if cursor is None or not page.jobs:
            break
        size = min(size * 2, MAX_PAGE)  # matches are sparse: fewer, larger reads
    return JobsPage(found, cursor, scanned)


@dataclass
class JobDetail:
    job: JobView
    curve: CurveResult | None


async def job_detail(client: AsyncClient, job_id: str) -> JobDetail:
    job = await client.status(job_id)
    try:
        curve: CurveResult | None = await client.curve(job_id)
    except RemoteError:  # not the user's to see in detail, or a daemon without curves
        curve = None
    return JobDetail(job, curve)


@dataclass
class UserQueue:
    uid: int
    queued: int = 0
    running: int = 0  # starting, running or restarting
    ranks: int = 0  # of its jobs not yet ended
    gpus: float = 0  # a rank may hold a share of a GPU


@dataclass
class DaemonPage:
    info: DaemonInfo
    load: tuple[float, float, float]
    cpus: int
    queues: list[UserQueue] = field(default_factory=list)


async def daemon_page(client: AsyncClient) -> DaemonPage:
    info = await client.daemon_info()
    queues: dict[int, UserQueue] = {}
    async for job in client.iter_jobs(all=False, page_size=MAX_PAGE):
        q = queues.setdefault(job.owner_uid, UserQueue(job.owner_uid))
        if job.state == JobState.QUEUED:
            q.queued += 1
        else:
            q.running += 1
        q.ranks += job.spec.nproc
        q.gpus += job.spec.nproc * (job.spec.gpus_per_rank or 0)
    load = os.getloadavg()  # /proc/loadavg: no blocking worth a thread
    return DaemonPage(info, load, os.cpu_count() or 1, sorted(queues.values(), key=lambda q: q.uid))
