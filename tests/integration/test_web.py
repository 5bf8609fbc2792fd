"""`ddpctl web` over HTTP against a real daemon and real jobs: the door (token, Host, origin), the JSON
and SSE endpoints, a state change arriving over SSE within a second, and cancel by POST."""

from __future__ import annotations

import html
import json
import os
import socket
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from ddpd.client import MAX_WORLD

from ..conftest import DaemonProc, assert_nothing_left, running_daemon
from ..scripts.helpers import gated, wait_state, wait_waiting_at_gate
from ..users import user_python_for_tests
from .webserver import DDPCTL, WebServer, web_server

pytestmark = pytest.mark.anyio

TIMEOUT = 120
NOBODY = 65534
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
    failed = await daemon.run(daemon.spec(task="tests.tasks:fail_at_step", steps=5, options={"rank": 0, "at_step": 2}))
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
                                  (f"/sse/jobs/{ok.id}/logs", {"rank": str(MAX_WORLD)}, "rank"),
                                  (f"/sse/jobs/{ok.id}/logs", {"stream": "nope"}, "stream")):
            reply = await http.get(web.at(path, **query))
            assert reply.status_code == 400 and word in reply.json()["message"], (path, query, reply.text)
        reply = await http.get(web.at("/api/jobs/nosuchjob"))
        assert reply.status_code == 404 and reply.json()["error"] == "not_found"
        reply = await http.get(web.at("/jobs/nosuchjob"))
        assert reply.status_code == 404 and "not_found" in reply.text
    assert_nothing_left([ok, failed])


PUSH_BOUND = 1.0  # seconds from a state change to the open pages, their periodic refresh off


async def watch_until(http: httpx.AsyncClient, url: str, element: str, before: str, after: str,
                      arrived: dict[str, float], shown: anyio.Event,
                      *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
    """Follow a page's stream: started once `element` shows `before`; when it shows `after`, the
    time it arrived goes into `arrived[element]` and `shown` is set."""
    started = False
    with anyio.fail_after(TIMEOUT):
        async for event, data in sse_messages(http, url):
            if event != "replace" or data["id"] != element:
                continue
            if not started and before in data["html"]:
                started = True
                task_status.started()
            elif started and after in data["html"]:
                arrived[element] = time.time()
                shown.set()
                return
    raise AssertionError(f"stream {url} ended without {after!r}")


async def test_a_state_change_is_pushed_to_an_open_page_within_a_second(daemon: DaemonProc, tmp_path: Path) -> None:
    """The push: the page's periodic refresh is off (`--refresh 0`), so only the event that the
    server's stream got from the daemon can bring SUCCEEDED to the open page (with the refresh on,
    its one-second tick would bring it within a second even with the push broken)."""
    gate = tmp_path / "gate"
    async with web_server(daemon.socket, "--refresh", "0") as web, httpx.AsyncClient(timeout=None) as http:
        job_id = await daemon.client.submit(gated(daemon, gate, name="live"))
        await until_html(http, web.at("/sse/jobs"), "jobs", f'data-job="{job_id}"')
        await wait_waiting_at_gate(daemon, job_id)
        html, _ = await until_html(http, web.at("/sse/jobs"), "jobs", 'data-state="RUNNING"')
        assert job_id in html
        pages = {"jobs": (web.at("/sse/jobs"), 'data-state="RUNNING"', 'data-state="SUCCEEDED"'),
                 "job": (web.at(f"/sse/jobs/{job_id}"), "RUNNING", "SUCCEEDED")}
        arrived: dict[str, float] = {}
        shown = {element: anyio.Event() for element in pages}
        async with anyio.create_task_group() as tg:
            for element, (url, before, after) in pages.items():  # each page open, showing RUNNING, first
                await tg.start(watch_until, http, url, element, before, after, arrived, shown[element])
            gate.touch()
            event = await wait_state(daemon, job_id, "SUCCEEDED")
            with anyio.fail_after(PUSH_BOUND + 10):  # the refresh is off: without the push nothing comes
                for done in shown.values():
                    await done.wait()
        late = {element: round(at - event.ts, 2) for element, at in arrived.items()}
        assert max(late.values()) < PUSH_BOUND, f"SUCCEEDED reached the pages this many seconds late: {late}"
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
        reply = await http.post(f"{web.origin}/jobs/{job_id}/stacks", headers={"x-ddpd-token": web.token})
        assert reply.status_code == 200 and "2 of 2" in reply.json()["summary"], reply.text
        assert "on_step" in reply.json()["text"]  # where the gated task holds its ranks
        reply = await http.post(f"{web.origin}/jobs/{job_id}/stacks")
        assert reply.status_code == 403
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


def _open_socket(base: Path) -> Path:
    """A config whose socket every user may open, in a directory nobody can reach."""
    base.chmod(0o755)
    config = base / "ddpd.toml"
    config.write_text('socket_mode = "0666"\n')
    return config


@pytest.mark.skipif(os.geteuid() != 0, reason="acting as a second user needs root")
async def test_another_user_sees_what_ddpctl_shows_them(short_tmp: Path, tmp_path: Path) -> None:
    """The view of a user who is not the job's owner: its row, no detail, no logs, no cancel."""
    config = _open_socket(short_tmp)
    with user_python_for_tests():
        async with running_daemon(short_tmp, "--config", str(config)) as d, web_server(d.socket, uid=NOBODY) as web:
            job_id = await d.client.submit(gated(d, tmp_path / "never", name="root's secret"))
            await wait_waiting_at_gate(d, job_id)
            async with httpx.AsyncClient(timeout=30) as http:
                [row] = (await http.get(web.at("/api/jobs"))).json()["jobs"]
                assert row["id"] == job_id and row["owner"] == "root" and row["state"] == "RUNNING"
                assert row["name"] == "" and "gate" not in json.dumps(row)
                page = (await http.get(web.at(f"/jobs/{job_id}"))).text
                assert "root's secret" not in page and "stacks-button" not in page
                async for event, data in sse_messages(http, web.at(f"/sse/jobs/{job_id}/logs")):
                    assert event == "append" and "owner, root and the admin group" in data["html"]
                    break
                reply = await http.post(f"{web.origin}/jobs/{job_id}/cancel", headers={"x-ddpd-token": web.token})
                assert reply.status_code == 403 and reply.json()["error"] == "permission_denied"
                assert (await d.client.status(job_id)).state == "RUNNING"
                await d.client.cancel(job_id)  # its events are not theirs: the page's tick brings the change
                await until_html(http, web.at("/sse/jobs"), "jobs", 'data-state="CANCELLED"')
            final = await d.client.wait(job_id)
    assert_nothing_left([final])


def test_the_chart_draws_finite_numbers_only() -> None:
    """NaN and infinite losses or rates never reach the SVG; an empty curve says so."""
    from ddpd.cli.web.chart import loss_svg
    from ddpd.client import CurvePoint, CurveResult

    nan, inf = float("nan"), float("inf")
    points = [CurvePoint(1.0, 1, 2.0, 1.0), CurvePoint(2.0, 2, nan, inf), CurvePoint(3.0, 3, inf, nan),
              CurvePoint(4.0, 4, 0.5, 2.0), CurvePoint(5.0, 5, None, None)]
    svg = loss_svg(CurveResult(job_id="<j>", state="RUNNING", points=points, steps=10))
    assert 'data-points="2"' in svg and "nan" not in svg.lower() and "inf" not in svg.lower() and "<j>" not in svg
    assert "no loss yet" in loss_svg(CurveResult(job_id="j", state="QUEUED", points=[]))
    flat = loss_svg(CurveResult(job_id="j", state="RUNNING", points=[CurvePoint(1.0, 1, 1.0, None)]))
    assert 'data-points="1"' in flat and "nan" not in flat.lower()


async def test_open_port_taken_and_no_daemon(daemon: DaemonProc, tmp_path: Path) -> None:
    """--open hands the browser a private file that redirects to the printed URL; a taken port and a
    missing daemon are one clear line."""
    opened = tmp_path / "opened"
    browser = tmp_path / "browser.sh"
    _write_script(browser, f'#!/bin/sh\necho "$1" > {opened}\n')
    os.mkfifo(opened)  # the browser command's handshake: it writes the URL it was given into it
    reader = os.open(opened, os.O_RDONLY | os.O_NONBLOCK)
    try:
        async with web_server(daemon.socket, "--open", env={"BROWSER": str(browser)}) as web:
            with anyio.fail_after(TIMEOUT):
                await anyio.wait_readable(reader)
            page = os.read(reader, 4096).decode().strip()
            assert page.startswith("file:///") and page.endswith("/open.html"), page
            assert f'content="0;url={html.escape(web.url)}"' in await anyio.Path(page.removeprefix("file://")).read_text()
    finally:
        os.close(reader)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        done = await anyio.run_process([DDPCTL, "--socket", str(daemon.socket), "web", "--port", port], check=False,
                                       stdin=subprocess.DEVNULL)
    assert done.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in done.stderr.decode(), done
    assert not done.stdout
    done = await anyio.run_process([DDPCTL, "--socket", str(tmp_path / "none.sock"), "web"], check=False,
                                   stdin=subprocess.DEVNULL)
    assert done.returncode == 3 and "cannot reach ddpd" in done.stderr.decode() and not done.stdout, done


def _write_script(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


def test_the_daemon_page_shows_each_gpu() -> None:
    """GPUs as NVML reports them (a stand-in DaemonInfo: no GPU here): memory, use, holders, others."""
    from ddpd.cli.web.data import DaemonPage, UserQueue
    from ddpd.cli.web.present import daemon_context, environment
    from ddpd.client import DaemonInfo, GpuView

    gpus = [GpuView(index=0, name="H100 <80GB>", memory_total=80 << 30, memory_used=3 << 30, utilization=97,
                    jobs=["j3-ab12"]),
            GpuView(index=1, name="H100", memory_total=80 << 30, memory_used=None, other_processes=2)]
    info = DaemonInfo(version="0", protocol=1, pid=1, uptime=5.0, socket="/s", state_dir="/d", running=1, queued=2,
                      cpu_slots=8, gpus=2, free_gpus=1, pool_ready=3, pool_state="warm (3 ready)", gpu_devices=gpus)
    page = DaemonPage(info, (1.0, 0.5, 0.25), 8, [UserQueue(0, queued=2, running=1, ranks=6, gpus=1.5)])
    html = environment().get_template("_daemon.html").render(**daemon_context(page))
    assert "H100 &lt;80GB&gt;" in html and "3.0 GiB of 80.0 GiB" in html and "97%" in html and "j3-ab12" in html
    assert "? of 80.0 GiB" in html and ">2<" in html and "warm (3 ready)" in html and "1 free of 2" in html
    assert "<td>root</td>" in html and ">1.5<" in html


async def test_the_hub_wakes_a_page_only_for_what_it_shows() -> None:
    """A page waits past events it does not want, wakes at one it wants or at close; one that fell out
    of the ring is told so (it then reads the daemon)."""
    from ddpd.cli.web.hub import RING, Hub
    from ddpd.client import AsyncClient, EventView

    hub = Hub(AsyncClient("/nonexistent/ddpd.sock"))
    hub.add(EventView(seq=1, ts=0.0, kind="job.submitted", job_id="j1"))
    start = hub.position
    woken: list[int] = []

    async def page() -> None:
        woken.append(await hub.wait(start, 60, lambda e: e.kind.startswith("job.")))

    async with anyio.create_task_group() as tg:
        tg.start_soon(page)
        await anyio.wait_all_tasks_blocked()
        hub.add(EventView(seq=0, ts=0.0, kind="rank.progress", job_id="j1"))
        await anyio.wait_all_tasks_blocked()
        assert woken == []
        hub.add(EventView(seq=2, ts=0.0, kind="job.state_changed", job_id="j1"))
    assert woken == [3] and [e.seq for e in hub.since(start) or []] == [0, 2]
    for seq in range(RING):
        hub.add(EventView(seq=seq + 3, ts=0.0, kind="job.x"))
    assert hub.since(start) is None and hub.since(hub.position) == []
    with anyio.fail_after(5):
        hub.close()
        assert await hub.wait(hub.position, 60) == hub.position
