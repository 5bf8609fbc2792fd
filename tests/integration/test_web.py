"""`ddpctl web` over HTTP against a real daemon and real jobs: the door (token, Host, origin), the JSON
and SSE endpoints, a state change arriving over SSE within a second, and cancel by POST."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from ..conftest import DaemonProc, assert_nothing_left
from ..scripts.helpers import gated, wait_state, wait_waiting_at_gate
from .webserver import WebServer, web_server

pytestmark = pytest.mark.anyio

TIMEOUT = 120
HOSTILE = "<img src=x onerror=alert(1)>"


@pytest.fixture
async def web(daemon: DaemonProc) -> AsyncIterator[WebServer]:
    async with web_server(daemon.socket) as server:
        yield server


async def sse_messages(http: httpx.AsyncClient, url: str) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """(event, data) of a server-sent-events stream, as they arrive."""
    async with http.stream("GET", url) as reply:
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
        event, lines = "message", []
        async for line in reply.aiter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                lines.append(line[6:])
            elif line == "" and lines:
                yield event, json.loads("\n".join(lines))
                event, lines = "message", []


async def until_html(http: httpx.AsyncClient, url: str, element: str, needle: str) -> tuple[str, float]:
    """The first `replace` of `element` that contains `needle`, and when it arrived."""
    with anyio.fail_after(TIMEOUT):
        async for event, data in sse_messages(http, url):
            if event == "replace" and data["id"] == element and needle in data["html"]:
                return data["html"], time.time()
    raise AssertionError(f"stream {url} ended without {needle!r}")


async def test_nothing_without_the_token_or_the_right_host(daemon: DaemonProc, web: WebServer) -> None:
    job = await daemon.run(daemon.spec(steps=2, name="secret-name"))
    async with httpx.AsyncClient(timeout=30) as http:
        for url in (f"{web.origin}/", f"{web.origin}/?token=wrong", f"{web.origin}/?token=",
                    f"{web.origin}/api/jobs", f"{web.origin}/static/app.js", f"{web.origin}/sse/jobs",
                    f"{web.origin}/?token={web.token}x", f"{web.origin}/api/jobs/{job.id}?token={'a' * 5000}"):
            reply = await http.get(url)
            assert reply.status_code == 403, url
            assert job.id not in reply.text and "secret-name" not in reply.text and "set-cookie" not in reply.headers
        # DNS rebinding: the right token under another name of this address is still refused
        for host in ("evil.example:80", f"localhost:{web.host.split(':')[1]}", "127.0.0.1", ""):
            reply = await http.get(web.at("/"), headers={"host": host})
            assert reply.status_code == 421 and job.id not in reply.text, host
        reply = await http.get(web.url)
        assert reply.status_code == 200 and job.id in reply.text and "secret-name" in reply.text
        assert "default-src 'none'" in reply.headers["content-security-policy"]
        reply = await http.get(f"{web.origin}/api/jobs", headers={"x-ddpd-token": web.token})
        assert reply.status_code == 200 and reply.json()["jobs"][0]["id"] == job.id
        reply = await http.get(web.at("/static/app.js"))
        assert reply.status_code == 200 and "EventSource" in reply.text
    assert_nothing_left([job])


async def test_json_pages_and_bad_queries(daemon: DaemonProc, web: WebServer) -> None:
    ok = await daemon.run(daemon.spec(steps=5, name=HOSTILE))
    failed = await daemon.run(daemon.spec(task="tests.tasks:fail_at_step", nproc=2, steps=5,
                                           options={"rank": 1, "at_step": 2}))
    async with httpx.AsyncClient(timeout=30) as http:
        body = (await http.get(web.at("/api/jobs"))).json()
        assert [j["id"] for j in body["jobs"]] == [failed.id, ok.id] and body["next"] is None
        assert body["jobs"][0]["owner"] == "root" and body["jobs"][0]["state"] == "FAILED"
        body = (await http.get(web.at("/api/jobs", state="SUCCEEDED", user="root"))).json()
        assert [j["id"] for j in body["jobs"]] == [ok.id]
        body = (await http.get(web.at("/api/jobs", limit="1"))).json()
        assert [j["id"] for j in body["jobs"]] == [failed.id] and body["next"] is not None
        body = (await http.get(web.at("/api/jobs", limit="1", before=str(body["next"])))).json()
        assert [j["id"] for j in body["jobs"]] == [ok.id]

        body = (await http.get(web.at(f"/api/jobs/{ok.id}"))).json()
        assert body["job"]["state"] == "SUCCEEDED" and body["curve"]["points"]
        page = (await http.get(web.at(f"/jobs/{ok.id}"))).text
        assert HOSTILE not in page and "&lt;img src=x onerror=alert(1)&gt;" in page and "<polyline" in page
        page = (await http.get(web.at(f"/jobs/{failed.id}"))).text
        assert "root cause" in page and "injected failure" in page
        daemon_info = (await http.get(web.at("/api/daemon"))).json()
        assert daemon_info["daemon"]["protocol"] >= 1 and daemon_info["queues"] == []
        assert "queue per user" in (await http.get(web.at("/daemon"))).text

        for path, query, word in (("/api/jobs", {"state": "BOGUS"}, "state"), ("/api/jobs", {"limit": "0"}, "limit"),
                                  ("/api/jobs", {"before": "-1"}, "before"), ("/api/jobs", {"user": "no body"}, "user"),
                                  ("/api/jobs", {"user": "nosuchuserhere"}, "nosuchuserhere"),
                                  (f"/sse/jobs/{ok.id}/logs", {"rank": "99999"}, "rank"),
                                  (f"/sse/jobs/{ok.id}/logs", {"stream": "nope"}, "stream")):
            reply = await http.get(web.at(path, **query))
            assert reply.status_code == 400 and word in reply.json()["message"], (path, query, reply.text)
        reply = await http.get(web.at("/api/jobs/nosuchjob"))
        assert reply.status_code == 404 and reply.json()["error"] == "not_found"
        reply = await http.get(web.at("/jobs/nosuchjob"))
        assert reply.status_code == 404 and "not_found" in reply.text
    assert_nothing_left([ok, failed])


async def test_a_state_change_reaches_an_open_page_within_a_second(daemon: DaemonProc, web: WebServer,
                                                                  tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    async with httpx.AsyncClient(timeout=None) as http:
        job_id = await daemon.client.submit(gated(daemon, gate, name="live"))
        await until_html(http, web.at("/sse/jobs"), "jobs", f'data-job="{job_id}"')
        await wait_waiting_at_gate(daemon, job_id)
        html, _ = await until_html(http, web.at("/sse/jobs"), "jobs", 'data-state="RUNNING"')
        assert job_id in html
        async with anyio.create_task_group() as tg:
            arrived: list[float] = []

            async def watch() -> None:
                arrived.append((await until_html(http, web.at("/sse/jobs"), "jobs", 'data-state="SUCCEEDED"'))[1])

            tg.start_soon(watch)
            # the page is open before the change: its first message is the RUNNING table
            await until_html(http, web.at(f"/sse/jobs/{job_id}"), "job", "RUNNING")
            gate.touch()
            event = await wait_state(daemon, job_id, "SUCCEEDED")
        assert arrived[0] - event.ts < 1.0, f"SUCCEEDED reached the page {arrived[0] - event.ts:.2f}s after it happened"
    assert_nothing_left([await daemon.client.status(job_id)])


async def test_job_stream_logs_and_cancel_by_post(daemon: DaemonProc, web: WebServer, tmp_path: Path) -> None:
    job_id = await daemon.client.submit(gated(daemon, tmp_path / "gate", nproc=2))
    await wait_waiting_at_gate(daemon, job_id, ranks=2)
    async with httpx.AsyncClient(timeout=30) as http:
        with anyio.fail_after(TIMEOUT):
            async for event, data in sse_messages(http, web.at(f"/sse/jobs/{job_id}/logs", rank="1")):
                assert event == "append" and "[0]" not in data["html"]
                if "rank 1 waiting for gate" in data["html"]:
                    break
        with anyio.fail_after(TIMEOUT):
            async for event, data in sse_messages(http, web.at(f"/sse/jobs/{job_id}")):
                if event == "append" and "job.state_changed" in data["html"]:
                    break
        cancel = f"{web.origin}/jobs/{job_id}/cancel"
        for headers in ({}, {"x-ddpd-token": "wrong"},
                        {"x-ddpd-token": web.token, "origin": "http://evil.example"},
                        {"x-ddpd-token": web.token, "sec-fetch-site": "cross-site"}):
            reply = await http.post(cancel, headers=headers)
            assert reply.status_code == 403, headers
        assert (await daemon.client.status(job_id)).state == "RUNNING"
        reply = await http.get(cancel, headers={"x-ddpd-token": web.token})
        assert reply.status_code == 405
        reply = await http.post(cancel, headers={"x-ddpd-token": web.token, "origin": web.origin})
        assert reply.status_code == 200 and reply.json()["action"] == "stopping", reply.text
        await wait_state(daemon, job_id, "CANCELLED")
        reply = await http.post(cancel, headers={"x-ddpd-token": web.token})
        assert reply.status_code in (200, 409), reply.text
    assert_nothing_left([await daemon.client.status(job_id)])
