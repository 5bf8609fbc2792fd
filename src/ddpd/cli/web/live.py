"""The live streams behind the pages: each re-renders its fragment on the hub's next event (or on
the tick, `ddpctl web --refresh`, one second by default, that keeps ages and heartbeats current)
and sends it when it changed.

A stream that cannot reach the daemon says so in the page's banner and tries again on the next tick;
the browser's EventSource reconnects by itself when the server itself went away.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import anyio
from markupsafe import escape

from ddpd.client import EventView, LogChunk, LogStream, RemoteError

from . import data, present, sse
from .context import Web
from .hub import Wanted

GAP = 0.2  # seconds between two refreshes of one page at least
FINAL_TICK = 10.0  # once the job has ended
EVENTS_SHOWN = 500  # a job's events on its page at most (the newest)
LOG_TAIL = 200  # lines of each rank a log view starts with

After = Callable[[], Coroutine[Any, Any, list[bytes]]]


async def _refreshing(web: Web, element: str, render: Callable[[], Coroutine[Any, Any, str]],
                      tick: Callable[[], float] | None = None, after: After | None = None,
                      wanted: Wanted = lambda event: True) -> AsyncIterator[bytes]:
    """`element` re-rendered on every event `wanted` and every tick (`web.refresh` unless `tick`
    says), sent when it differs, at most once every GAP seconds; then what `after` adds (a job's
    new events)."""
    last: str | None = None
    said: str | None = None
    position = web.hub.position
    while not web.hub.closed:
        began = anyio.current_time()
        try:
            html: str | None = await render()
            banner = web.hub.error or ""
        except RemoteError as exc:  # the page keeps what it shows and says why it is not current
            html, banner = None, f"{exc.code}: {exc.message}"
        if html is not None and html != last:
            yield sse.replace(element, html)
            last = html
        if banner != said:
            yield sse.replace("banner", str(escape(banner)))
            said = banner
        for extra in [] if after is None else await after():
            yield extra
        await anyio.sleep(GAP - (anyio.current_time() - began))  # a burst of events: one render
        position = await web.hub.wait(position, web.refresh if tick is None else tick(), wanted)


def _job_level(event: EventView) -> bool:
    """An event that may change a row of the jobs table or the daemon's figures (not a rank's step)."""
    return not event.kind.startswith("rank.")


def jobs(web: Web, flt: data.JobFilter) -> AsyncIterator[bytes]:
    async def render() -> str:
        page = await data.jobs_page(web.client, flt)
        return web.render("_jobs.html", rows=[present.job_row(j, time.time()) for j in page.jobs],
                          next=page.next, flt=flt, scanned=page.scanned)

    return _refreshing(web, "jobs", render, wanted=_job_level)


def daemon(web: Web) -> AsyncIterator[bytes]:
    async def render() -> str:
        return web.render("_daemon.html", **present.daemon_context(await data.daemon_page(web.client)))

    return _refreshing(web, "daemon", render, wanted=_job_level)


async def job(web: Web, job_id: str) -> AsyncIterator[bytes]:
    """The job's live part (state, ranks, curve) and its events as they come."""
    final = False
    position = web.hub.position  # before the first read: nothing falls between the two
    shown, last_seq = await _job_events(web, job_id)

    buttons = ""

    async def render() -> str:
        nonlocal final, buttons
        detail = await data.job_detail(web.client, job_id)
        final = detail.job.state in present.FINAL
        context = present.job_context(detail, time.time(), web.viewer)
        buttons = web.render("_buttons.html", **context)
        return web.render("_job.html", **context)

    async def events() -> list[bytes]:  # and the buttons, which go as the job ends
        nonlocal position, last_seq
        new, position, last_seq = await _newer_events(web, job_id, position, last_seq)
        return [sse.replace("buttons", buttons), *([sse.append("events", _event_rows(web, new))] if new else [])]

    if shown:
        yield sse.append("events", _event_rows(web, shown))
    async for message in _refreshing(web, "job", render, lambda: FINAL_TICK if final else web.refresh, events,
                                     lambda event: event.job_id == job_id):
        yield message


async def _job_events(web: Web, job_id: str, since: int = 0) -> tuple[list[EventView], int]:
    """The job's events after `since` (the newest EVENTS_SHOWN), and the last seq seen."""
    kept: deque[EventView] = deque(maxlen=EVENTS_SHOWN)
    last = since
    try:
        async with web.client.events(job_id, since=since) as stream:
            async for event in stream:
                last = max(last, event.seq)
                if present.shown_event(event):
                    kept.append(event)
    except RemoteError:  # not the user's to see, or gone: the page shows what status shows
        pass
    return list(kept), last


async def _newer_events(web: Web, job_id: str, position: int, last_seq: int) -> tuple[list[EventView], int, int]:
    new = web.hub.since(position)
    now = web.hub.position
    if new is None:  # the page fell out of the hub's ring: read them from the daemon
        events, last = await _job_events(web, job_id, last_seq)
        return events, now, last
    mine = [e for e in new if e.job_id == job_id and e.seq > last_seq and present.shown_event(e)]
    return mine, now, max([last_seq, *(e.seq for e in mine)])


def _event_rows(web: Web, events: list[EventView]) -> str:
    return web.render("_events.html", events=[present.event_row(e) for e in events])


async def logs(web: Web, job_id: str, rank: int | None, stream: LogStream) -> AsyncIterator[bytes]:
    """The rank logs following: the last LOG_TAIL lines of each rank, then new lines as they come."""
    follow = web.client.logs(job_id, follow=True, ranks=None if rank is None else [rank], stream=stream,
                             tail=LOG_TAIL)
    try:
        with web.hub.following(follow):
            async with follow as chunks:
                async for chunk in chunks:
                    yield sse.append("log", log_html(chunk))
    except RemoteError as exc:
        if web.hub.closed:
            yield sse.end("the web view stopped")
            return
        yield sse.append("log", f'<div class="l error">{escape(exc.message)}</div>')
    yield sse.end("the job's logs end here")


def log_html(chunk: LogChunk) -> str:
    if chunk.error:
        return f'<div class="l error">[{chunk.rank}] {escape(chunk.error)}</div>'
    stamp = "" if chunk.time is None else time.strftime("%H:%M:%S", time.localtime(chunk.time)) + \
        f".{int(chunk.time * 1000) % 1000:03d}"
    cls = f"l {chunk.stream or ''}".rstrip()
    lines = chunk.text.rstrip("\n").split("\n")
    return "".join(f'<div class="{cls}"><time>{stamp}</time><b>[{chunk.rank}]</b> {escape(line)}</div>'
                   for line in lines)
