"""The web view's routes (Starlette), every one behind the `guard`.

Pages: `/` (jobs), `/jobs/{id}`, `/daemon`. Their live parts: `/sse/jobs`, `/sse/jobs/{id}`,
`/sse/jobs/{id}/logs`, `/sse/daemon`. JSON: `/api/jobs`, `/api/jobs/{id}`, `/api/daemon`. Actions
(POST, the token in the `X-DDPD-Token` header): `/jobs/{id}/cancel`, `/jobs/{id}/stacks`. Static
files under `/static/`. A bad query value is a 400 naming it; a daemon's error reply keeps its code.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp

from ddpd.client import DaemonUnavailable, ErrorCode, RemoteError, StacksResult

from .. import render as cli_render
from .. import stacks as cli_stacks
from . import data, live, present, sse
from .context import Web
from .guard import Guard

STATUS_OF = {ErrorCode.NOT_FOUND.value: 404, ErrorCode.AMBIGUOUS.value: 404, ErrorCode.OTHER_NODE.value: 404,
             ErrorCode.PERMISSION_DENIED.value: 403, ErrorCode.NOT_RUNNABLE.value: 409}
LOG_STREAMS = ("both", "stdout", "stderr")


def _query(request: Request) -> dict[str, str]:
    return {k: v for k, v in request.query_params.items() if k != "token"}


def _job_id(request: Request) -> str:
    return data.check_job_id(str(request.path_params["job_id"]))


class Handlers:
    """One method per route, over the shared `Web`."""

    def __init__(self, web: Web) -> None:
        self.web = web

    def page(self, template: str, **context: Any) -> HTMLResponse:
        return HTMLResponse(self.web.render(template, **context))

    async def jobs_page(self, request: Request) -> Response:
        flt = data.job_filter(_query(request))
        page = await data.jobs_page(self.web.client, flt)
        return self.page("jobs.html", flt=flt, states=present.STATES, next=page.next, scanned=page.scanned,
                         rows=[present.job_row(j, time.time()) for j in page.jobs])

    async def job_page(self, request: Request) -> Response:
        detail = await data.job_detail(self.web.client, _job_id(request))
        return self.page("job.html", **present.job_context(detail, time.time(), self.web.viewer))

    async def daemon_page(self, request: Request) -> Response:
        return self.page("daemon.html", **present.daemon_context(await data.daemon_page(self.web.client)))

    async def jobs_api(self, request: Request) -> Response:
        page = await data.jobs_page(self.web.client, data.job_filter(_query(request)))
        return JSONResponse({"jobs": [present.job_json(j) for j in page.jobs], "next": page.next,
                             "scanned": page.scanned})

    async def job_api(self, request: Request) -> Response:
        detail = await data.job_detail(self.web.client, _job_id(request))
        return JSONResponse({"job": present.job_json(detail.job), "curve": msgspec.to_builtins(detail.curve)})

    async def daemon_api(self, request: Request) -> Response:
        page = await data.daemon_page(self.web.client)
        return JSONResponse({"daemon": msgspec.to_builtins(page.info), "load": list(page.load), "cpus": page.cpus,
                             "queues": [{"uid": q.uid, "user": present.owner_name(q.uid), "queued": q.queued,
                                         "running": q.running, "ranks": q.ranks, "gpus": q.gpus}
                                        for q in page.queues]})

    async def jobs_sse(self, request: Request) -> Response:
        return sse.response(live.jobs(self.web, data.job_filter(_query(request))))

    async def job_sse(self, request: Request) -> Response:
        return sse.response(live.job(self.web, _job_id(request)))

    async def logs_sse(self, request: Request) -> Response:
        query = _query(request)
        rank_text = query.get("rank") or None
        rank = None if rank_text is None else data.rank_of(rank_text)
        stream = query.get("stream") or "both"
        if stream not in LOG_STREAMS:
            raise data.BadQuery(f"stream must be one of {', '.join(LOG_STREAMS)}")
        return sse.response(live.logs(self.web, _job_id(request), rank, stream))  # type: ignore[arg-type]

    async def daemon_sse(self, request: Request) -> Response:
        return sse.response(live.daemon(self.web))

    async def cancel(self, request: Request) -> Response:
        result = await self.web.client.cancel(_job_id(request))
        return JSONResponse({"action": result.action, "state": result.job.state,
                             "line": cli_render.cancel_line(result)})

    async def stacks(self, request: Request) -> Response:
        result: StacksResult = await self.web.client.stacks(_job_id(request))
        answered = sum(1 for r in result.ranks if r.answered)
        notes = [f"rank {r.rank} ({r.state}): {r.note}" for r in result.ranks if r.note]
        return JSONResponse({"summary": f"attempt {result.attempt}: {answered} of {len(result.ranks)} rank(s) "
                                        "answered", "notes": notes + ([result.note] if result.note else []),
                             "text": cli_stacks.render(result)})


async def _bad_query(request: Request, exc: Exception) -> Response:
    return _error(request, 400, "bad_query", str(exc))


async def _remote(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RemoteError)
    status = 503 if isinstance(exc, DaemonUnavailable) else STATUS_OF.get(exc.code, 502)
    return _error(request, status, exc.code, exc.message)


async def _http(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return _error(request, exc.status_code, "http", exc.detail)


def _error(request: Request, status: int, code: str, message: str) -> Response:
    if request.url.path.startswith(("/api/", "/sse/")) or request.method != "GET":
        return JSONResponse({"error": code, "message": message}, status_code=status)
    web: Web = request.app.state.web
    return HTMLResponse(web.render("error.html", status=status, code=code, message=message), status_code=status)


def create_app(web: Web, host: str) -> ASGIApp:
    h = Handlers(web)
    routes = [
        Route("/", h.jobs_page), Route("/jobs/{job_id}", h.job_page), Route("/daemon", h.daemon_page),
        Route("/api/jobs", h.jobs_api), Route("/api/jobs/{job_id}", h.job_api), Route("/api/daemon", h.daemon_api),
        Route("/sse/jobs", h.jobs_sse), Route("/sse/jobs/{job_id}", h.job_sse),
        Route("/sse/jobs/{job_id}/logs", h.logs_sse), Route("/sse/daemon", h.daemon_sse),
        Route("/jobs/{job_id}/cancel", h.cancel, methods=["POST"]),
        Route("/jobs/{job_id}/stacks", h.stacks, methods=["POST"]),
        Mount("/static", StaticFiles(packages=[("ddpd.cli.web", "static")]), name="static"),
    ]
    app = Starlette(routes=routes, exception_handlers={data.BadQuery: _bad_query, RemoteError: _remote,
                                                       HTTPException: _http})
    app.state.web = web
    return Guard(app, web.token, host)
