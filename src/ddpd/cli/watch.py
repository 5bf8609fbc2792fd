"""`ddpctl watch`: a live view of one job or of all jobs, refreshed on every event of the daemon.

One event loop: a task reads the follow-stream of events and only wakes the refresher, which
redraws once per burst of events and once a second for the heartbeat ages. With a job, it ends
when the job is final; without one, it runs until interrupted. A job's view ends with its progress
line: steps per second, the time left to its last step, and a sparkline of its loss (see `curves`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio
from rich.console import Group, RenderableType
from rich.live import Live
from rich.text import Text

from ddpd.client import AsyncClient, CurveResult, JobView, RemoteError

from . import curves, output, render
from .reconnect import RECONNECT_DEFAULT, ride_out_async

REFRESH = 1.0  # seconds between redraws when no event comes


Show = Callable[[list[JobView], CurveResult | None], None]


def watch_view(views: list[JobView], single: bool, curve: CurveResult | None = None) -> RenderableType:
    now = time.time()
    if single:
        detail = render.job_detail(views[0], now)
        line = "" if curve is None else curves.progress_line(curve, views[0].state in render.FINAL)
        return Group(detail, Text(line)) if line else detail
    active = [v for v in views if v.state not in render.FINAL]  # running and queued first, history below
    history = [v for v in views if v.state in render.FINAL]
    parts: list[RenderableType] = [render.jobs_table(active, now, progress=True, title="active")
                                   if active else Text("no active jobs")]
    if history:
        parts.append(render.jobs_table(history, now, title="history"))
    for job in [v for v in active if v.ranks][:8]:
        parts.append(render.ranks_table(job, title=f"{job.id} {job.name}".rstrip()))
    return Group(*parts)


async def _curve(client: AsyncClient, job_id: str) -> CurveResult | None:
    try:
        return await client.curve(job_id)
    except RemoteError:  # a daemon without curves: the view goes on without its progress line
        return None


async def follow(client: AsyncClient, job_id: str | None, show: Show) -> JobView | None:
    """Refresh on every event and once a second; returns the watched job once it is final."""

    async def refresh() -> JobView | None:
        if job_id is not None:
            view = await client.status(job_id)
            show([view], await _curve(client, job_id))
            return view if view.state in render.FINAL else None
        show(await client.list_jobs(), None)
        return None

    final = await refresh()  # a bad JOB fails here, before the stream starts
    if final is not None:
        return final
    changed = anyio.Event()
    ended = False
    failure: Exception | None = None

    async def pump() -> None:
        nonlocal ended, failure
        try:
            async with client.events(job_id, follow=True) as stream:
                async for _ in stream:
                    changed.set()
            ended = True
        except Exception as exc:
            failure = exc
        changed.set()

    async def redraw() -> JobView:
        nonlocal changed
        while True:
            with anyio.move_on_after(REFRESH):
                await changed.wait()
            changed = anyio.Event()  # one refresh for a burst of events
            final = await refresh()
            if final is not None:
                return final
            if failure is not None:
                raise failure
            if ended and job_id is None:
                raise RemoteError("stream_ended", "the daemon ended the event stream")
            # a job's stream ends at job.finished: the next refresh sees it final

    error: Exception | None = None
    async with anyio.create_task_group() as tg:
        tg.start_soon(pump)
        try:
            final = await redraw()
        except Exception as exc:  # raised below, outside the task group, as it is
            error = exc
        tg.cancel_scope.cancel()
    if error is not None:
        raise error
    return final


async def follow_through(client: AsyncClient, job_id: str | None, show: Show, reconnect: float) -> JobView | None:
    """`follow`, started again each time the daemon came back after going away (see `reconnect`)."""
    while True:
        try:
            return await follow(client, job_id, show)
        except RemoteError as exc:
            await ride_out_async(client, reconnect, exc)


def run_watch(client: AsyncClient, job_id: str | None, as_json: bool,
              reconnect: float = RECONNECT_DEFAULT) -> JobView | None:
    """Run the view until the job ends (its final view) or Ctrl-C (None, after a clean exit)."""
    if as_json:
        try:
            return anyio.run(follow_through, client, job_id,
                             lambda views, _: output.print_json(views[0] if job_id is not None else views), reconnect)
        except KeyboardInterrupt:
            return None
    console = output.stdout()
    shown = False
    live = Live(Text(""), console=console, refresh_per_second=4)

    def show(views: list[JobView], curve: CurveResult | None) -> None:
        nonlocal shown
        shown = True
        live.update(watch_view(views, job_id is not None, curve), refresh=True)

    try:
        with live:
            return anyio.run(follow_through, client, job_id, show, reconnect)
    except KeyboardInterrupt:
        return None
    finally:
        if shown and not console.is_terminal:
            console.line()  # Live ends its last frame with a newline only on a terminal
