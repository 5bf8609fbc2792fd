"""`ddpctl web` in a real browser: headless Chromium against a real daemon, real jobs and the real
command. A job submitted from the CLI goes QUEUED -> RUNNING -> SUCCEEDED in the jobs table without
a reload; its page's curve gains points and its logs arrive; cancel on a second job's page ends it;
a page opened without the token shows nothing. Each test saves a screenshot in its temp dir."""

from __future__ import annotations

import shutil
from pathlib import Path

import anyio
import pytest

from ..conftest import REPO, DaemonProc, assert_nothing_left, running_daemon
from ..integration.webserver import DDPCTL, WebServer, web_server
from ..scripts.helpers import wait_state, wait_waiting_at_gate
from .conftest import Browser

pytestmark = pytest.mark.anyio

KEEP = Path("/tmp/web-screenshot.png")  # one screenshot kept where a person can look at it


async def ddpctl_submit(d: DaemonProc, *args: str) -> str:
    done = await anyio.run_process([DDPCTL, "--socket", str(d.socket), "submit", *args], cwd=str(REPO))
    return done.stdout.decode().strip()


def row_state(job_id: str) -> str:
    return f"(document.getElementById({job_id!r}.replace(/^/, 'job-')) || {{dataset: {{}}}}).dataset.state"


async def test_a_job_goes_live_through_the_table_and_its_page(short_tmp: Path, tmp_path: Path,
                                                             browser: Browser) -> None:
    gate = tmp_path / "gate"
    async with running_daemon(short_tmp, "--cpu-slots", "2") as d, web_server(d.socket) as web:
        # a job holding both CPU slots, so the watched one waits in the queue first
        blocker = await ddpctl_submit(d, "--task", "tests.scripts.gated:make_task", "--nproc", "2", "--steps", "2",
                                      "--option", f"gate={gate}", "--name", "blocker")
        await wait_waiting_at_gate(d, blocker, ranks=2)
        await browser.get(web.url)
        await browser.until("document.getElementById('live-state').textContent === 'live'")
        await browser.js("window.notReloaded = true")
        job_id = await ddpctl_submit(d, "--task", "tests.browser.tasks:chatty", "--nproc", "2", "--steps", "150",
                                     "--option", "step_sleep=0.04", "--name", "watched")
        assert await browser.until(row_state(job_id)) == "QUEUED"
        await browser.screenshot(tmp_path / "queued.png")
        gate.touch()
        await browser.until(f"{row_state(job_id)} === 'RUNNING'")
        assert await browser.js("return window.notReloaded === true"), "the jobs page was reloaded"

        await browser.click(f"#job-{job_id} a")
        await browser.until(f"(document.querySelector('h1') || {{}}).textContent?.includes({job_id!r})")
        first = await browser.until("Number(document.querySelector('svg.chart').dataset.points) >= 2 && "
                                    "Number(document.querySelector('svg.chart').dataset.points)")
        await browser.until(f"Number(document.querySelector('svg.chart').dataset.points) > {first}")
        await browser.until("document.querySelectorAll('#log .l').length >= 2")
        lines = await browser.js("return document.querySelectorAll('#log .l').length")
        await browser.until(f"document.querySelectorAll('#log .l').length > {lines}")
        assert "at step" in await browser.js("return document.getElementById('log').innerText")
        assert await browser.until("document.getElementById('rate').textContent.includes('steps/s')")
        await browser.screenshot(tmp_path / "job.png")
        shutil.copyfile(tmp_path / "job.png", KEEP)
        await browser.until("document.getElementById('job-state').textContent === 'SUCCEEDED'")
        await browser.until("document.querySelector('#events').innerText.includes('job.finished')")

        await browser.get(web.url)
        assert await browser.until(row_state(job_id)) == "SUCCEEDED"
        await browser.screenshot(tmp_path / "jobs.png")
        await browser.click("nav a[href^='/daemon']")
        await browser.until("document.getElementById('queued') && document.body.innerText.includes('queue per user')")
        await browser.screenshot(tmp_path / "daemon.png")
        jobs = [await d.client.status(j) for j in (blocker, job_id)]
    assert_nothing_left(jobs)


async def test_cancel_on_the_job_page(daemon: DaemonProc, tmp_path: Path, browser: Browser) -> None:
    job_id = await ddpctl_submit(daemon, "--task", "tests.scripts.gated:make_task", "--nproc", "2", "--steps", "2",
                                 "--option", f"gate={tmp_path / 'never'}", "--name", "to-cancel")
    await wait_waiting_at_gate(daemon, job_id, ranks=2)
    async with web_server(daemon.socket) as web:
        await browser.get(web.at(f"/jobs/{job_id}"))
        await browser.until("document.getElementById('job-state').textContent === 'RUNNING'")
        await browser.until("document.getElementById('live-state').textContent === 'live'")
        await browser.click("#cancel-button")
        assert job_id in await browser.accept_confirm()
        await browser.until("document.getElementById('action-result').textContent.includes('stopping')")
        await wait_state(daemon, job_id, "CANCELLED")
        await browser.until("document.getElementById('job-state').textContent === 'CANCELLED'")
        await browser.until("!document.getElementById('cancel-button') && !document.getElementById('stacks-button')")
        await browser.screenshot(tmp_path / "cancelled.png")
    assert_nothing_left([await daemon.client.status(job_id)])


async def test_the_chart_of_a_narrow_loss_in_a_long_job(daemon: DaemonProc, tmp_path: Path,
                                                        browser: Browser) -> None:
    """The live chart of a job 40-odd steps into 400,000 whose loss went from 1.0051 to 1.0037: its
    loss ticks read differently (they read 1.01, 1, 1, 1, 1) and its x axis spans the steps run, the
    planned end said in words (the steps run were a vertical line at the left edge)."""
    job_id = await ddpctl_submit(daemon, "--task", "tests.browser.tasks:narrow", "--nproc", "2", "--steps", "400000",
                                 "--option", "step_sleep=0.02", "--option", "span=40", "--name", "narrow")
    async with web_server(daemon.socket) as web:
        await browser.get(web.at(f"/jobs/{job_id}"))
        await browser.until("Number((document.querySelector('svg.chart') || {dataset: {}}).dataset.points) >= 8")
        chart = "document.querySelector('svg.chart')"
        await browser.until(f"{chart}.querySelector('.label').textContent === 'step (of 400000 planned)'")
        ticks = await browser.js(f"return [...{chart}.querySelectorAll('text.tick:not(.rate-label)')]"
                                 ".map(t => [Number(t.getAttribute('x')), t.textContent])")
        loss_labels = [text for x, text in ticks if x < 64]  # right-aligned left of the frame
        assert len(loss_labels) >= 2 and len(set(loss_labels)) == len(loss_labels), loss_labels
        assert all(1.0037 <= float(text) <= 1.0051 for text in loss_labels), loss_labels
        step_labels = [int(text) for x, text in ticks if x >= 64]
        assert step_labels and max(step_labels) < 40_000, step_labels  # the steps run, not the 400000 planned
        last = await browser.js(f"return Number({chart}.querySelector('circle.last').getAttribute('cx'))")
        assert last == 720 - 56  # the latest step ends the axis
        await browser.screenshot(tmp_path / "narrow.png")
    await daemon.client.cancel(job_id, force=True)
    await wait_state(daemon, job_id, "CANCELLED")
    assert_nothing_left([await daemon.client.status(job_id)])


async def test_no_token_no_page(daemon: DaemonProc, tmp_path: Path, browser: Browser) -> None:
    job = await daemon.run(daemon.spec(steps=2, name="private-name"))
    async with web_server(daemon.socket) as web:
        await browser.get(f"{web.origin}/jobs/{job.id}")
        text = await browser.js("return document.documentElement.innerText")
        assert "403" in text and job.id not in text and "private-name" not in text
        assert await browser.js("return document.cookie") == ""
        await browser.screenshot(tmp_path / "refused.png")
        await browser.get(_with_host_localhost(web))
        text = await browser.js("return document.documentElement.innerText")
        assert "421" in text and job.id not in text
    assert_nothing_left([job])


def _with_host_localhost(web: WebServer) -> str:
    """The right token under another name of this machine: refused (the Host check)."""
    return web.url.replace("127.0.0.1", "localhost")
