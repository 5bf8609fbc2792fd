"""Who sees what of a job: its detail for its owner, root and the admin group; its existence for all.

A job's detail (spec, environment, arguments, logs, events, stacks) is for its owner, root and the
members of the config's `admin_group` (`identity.may_see_detail`). Anyone else who may talk to the
daemon sees that the job exists, as `squeue` shows it (`replies.summary_view`): the event stream
leaves out the events of such jobs, and their logs and events are refused. A per-user daemon
serves only its own uid, which sees everything.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import anyio
import anyio.to_thread

from ...protocol.control import Events, EventView
from ..contain.identity import Identity, UnknownUser, admin_gid, may_see_detail
from ..queue.facade import Jobs
from ..store.journal import Journal
from ..store.records import Job
from .replies import Detail
from .streams import job_events


def viewer_of(uid: int, group: str | None) -> tuple[Identity | None, int | None]:
    """Blocking (NSS lookups): the viewer's identity (None: no passwd entry) and the admin gid."""
    try:
        viewer: Identity | None = Identity.of(uid)
    except UnknownUser:
        viewer = None
    return viewer, admin_gid(group)


def _sees_all(uid: int) -> bool:
    return uid == 0 or os.geteuid() != 0  # root; or the one user a per-user daemon serves


def detail_rule(uid: int, viewer: Identity | None, admin: int | None) -> Detail:
    """Whose jobs' detail `uid` (`viewer`, from `viewer_of`) may see, as a predicate over the owner's uid."""
    if _sees_all(uid):
        return lambda owner: True
    if viewer is None:
        return lambda owner: owner == uid
    return lambda owner: may_see_detail(viewer, owner, admin)


async def detail_for(uid: int, admin_group: str | None) -> Detail:
    """`detail_rule` of `uid`, looked up off the loop (and not at all for those who see everything)."""
    if _sees_all(uid):
        return detail_rule(uid, None, None)
    viewer, admin = await anyio.to_thread.run_sync(viewer_of, uid, admin_group)
    return detail_rule(uid, viewer, admin)


def not_yours(job: Job, what: str) -> str:
    return f"job {job.id} belongs to uid {job.owner_uid}; its {what} are for its owner, root and the admin group"


async def visible_events(jobs: Jobs, journal: Journal, req: Events, uid: int,
                         detail: Detail) -> AsyncIterator[EventView]:
    """Every job's events (`events` without a job id), less those of jobs `uid` may not see in detail."""
    owners: dict[str, int | None] = {}
    async for event in job_events(journal, None, req):
        if event.job_id is not None:
            if event.job_id not in owners:
                job = await jobs.find(event.job_id, missing_ok=True)
                owners[event.job_id] = None if job is None else job.owner_uid
            owner = owners[event.job_id]
            if not (detail(owner) if owner is not None else uid == 0):
                continue
        yield event
