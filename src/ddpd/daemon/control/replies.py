"""Replies kept under the frame limit: job views with clipped texts, pages of `list`, clipped events.

Whatever a job or a user put into the daemon (a 400 KB exception message, a spec near the request
limit, a long traceback in an event), a reply stays one frame: texts are clipped (head and tail
kept) when viewed, a view that is still too large loses its rank table and then the spec's free
text, and a page of `list` ends before its encoded size nears the limit.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Mapping

import msgspec

from ...protocol import MAX_FRAME, JobSpec
from ...protocol.control import EventView, JobPage, JobView
from ...protocol.limits import TEXT_LIMIT, clip_text, clip_value
from ..store.records import Job

PAGE_BUDGET = MAX_FRAME - 16 * 1024  # encoded jobs of one page at most (room for the envelope)
VIEW_BUDGET = PAGE_BUDGET


Detail = Callable[[int], bool]  # may the viewer see the detail of a job of this owner uid?


def summary_view(view: JobView) -> JobView:
    """What anyone may see of a job: that it exists, whose it is, its state and its resources."""
    spec = view.spec
    shape = JobSpec(nproc=spec.nproc, device=spec.device, gpus_per_rank=spec.gpus_per_rank, priority=spec.priority,
                    task=None, steps=0)
    return JobView(id=view.id, name="", state=view.state, owner_uid=view.owner_uid, submitted_at=view.submitted_at,
                   spec=shape, attempt=view.attempt, started_at=view.started_at, finished_at=view.finished_at,
                   queue_position=view.queue_position, pending=_summary_pending(view.pending))


def _summary_pending(pending: str | None) -> str | None:
    """A pending reason as anyone may see it: which dependencies a job waits for is its detail."""
    return "dependency" if pending is not None and pending.startswith("dependency") else pending


def positioned(view: JobView, positions: Mapping[str, int]) -> JobView:
    """The view with its place in the queue (`Scheduler.queue_positions`) where it is queued."""
    place = positions.get(view.id)
    return view if place == view.queue_position else msgspec.structs.replace(view, queue_position=place)


def visible_view(view: JobView, detail: Detail) -> JobView:
    view = fit_view(view)
    return view if detail(view.owner_uid) else summary_view(view)


def fit_view(view: JobView) -> JobView:
    """The view with its texts clipped (and no environment values); smaller still if it would not fit in one page."""
    if view.spec.environ is not None:
        view = msgspec.structs.replace(view, spec=msgspec.structs.replace(view.spec, environ=None))
    view = msgspec.structs.replace(view, name=clip_text(view.name, 200),
                                   reason=None if view.reason is None else clip_text(view.reason, TEXT_LIMIT),
                                   root_cause=None if view.root_cause is None else view.root_cause.clipped())
    if len(msgspec.json.encode(view)) <= VIEW_BUDGET:
        return view
    view = msgspec.structs.replace(view, ranks=[])
    if len(msgspec.json.encode(view)) <= VIEW_BUDGET:
        return view
    spec = view.spec  # a spec stored before the request limit existed: keep its shape, not its text
    small = JobSpec(name=clip_text(spec.name, 200), task=spec.task, nproc=spec.nproc, backend=spec.backend,
                    device=spec.device, gpus_per_rank=spec.gpus_per_rank, steps=spec.steps, seed=spec.seed,
                    timeouts=spec.timeouts, max_restarts=spec.max_restarts, priority=spec.priority)
    return msgspec.structs.replace(view, spec=small)


def job_page(jobs: Iterable[Job], *, active_only: bool, limit: int, before: int | None,
             detail: Detail = lambda owner: True, positions: Mapping[str, int] | None = None) -> JobPage:
    """Newest first: at most `limit` jobs with seq below `before`; `next` continues, None at the end."""
    wanted = (j for j in jobs if (before is None or j.seq < before) and not (active_only and j.state.final))
    newest = heapq.nlargest(limit + 1, wanted, key=lambda j: j.seq)
    views: list[JobView] = []
    size = 0
    for job in newest[:limit]:
        view = visible_view(positioned(job.view(), positions or {}), detail)
        n = len(msgspec.json.encode(view)) + 1
        if views and size + n > PAGE_BUDGET:
            break
        views.append(view)
        size += n
    more = len(views) < len(newest)
    return JobPage(jobs=views, next=newest[len(views) - 1].seq if more and views else None)


def clip_event(event: EventView) -> EventView:
    data = clip_value(event.data)
    return event if data == event.data else msgspec.structs.replace(event, data=data)
