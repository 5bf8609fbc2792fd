"""How fast `ddpctl web` serves its pages with many jobs in history (not a test: a measurement).

    .venv/bin/python -m tests.integration.web_bench [JOBS]

A real daemon gets a gated job holding both CPU slots, then JOBS (1000) jobs, each submitted and
cancelled while queued; a real `ddpctl web` then serves each page 15 times and the median and
worst time of each are printed; last, the time a SUCCEEDED takes from the daemon's event to an open
jobs page's stream, for a new gated job let go once the page showed it RUNNING.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio
import httpx

from ..conftest import DaemonProc, running_daemon
from .webserver import web_server

ROUNDS = 15


async def _history(d: DaemonProc, jobs: int) -> None:
    limit = anyio.Semaphore(8)

    async def one(i: int) -> None:
        async with limit:
            await d.client.cancel(await d.client.submit(d.spec(nproc=1, steps=2, name=f"history-{i}")))

    async with anyio.create_task_group() as tg:
        for i in range(jobs):
            tg.start_soon(one, i)


async def main(jobs: int) -> None:
    base = Path(tempfile.mkdtemp(prefix="ddpd-b"))
    gate = base / "gate"
    async with running_daemon(base, "--cpu-slots", "2") as d:
        blocker = await d.client.submit(d.spec(task="tests.scripts.gated:make_task", nproc=2, steps=2,
                                               options={"gate": str(gate)}))
        start = time.perf_counter()
        await _history(d, jobs)
        print(f"{jobs} jobs submitted and cancelled in {time.perf_counter() - start:.1f}s")
        async with web_server(d.socket) as web, httpx.AsyncClient(timeout=30) as http:
            pages = {"jobs (50 rows)": web.at("/"), "jobs, state=CANCELLED": web.at("/", state="CANCELLED"),
                     "jobs, state=SUCCEEDED (none)": web.at("/", state="SUCCEEDED"),
                     "jobs, user=root": web.at("/", user="root"), "jobs (500 rows)": web.at("/", limit="500"),
                     "/api/jobs": web.at("/api/jobs"), "daemon": web.at("/daemon"),
                     "a job": web.at(f"/jobs/{blocker}")}
            for label, url in pages.items():
                times = []
                for _ in range(ROUNDS):
                    begin = time.perf_counter()
                    reply = await http.get(url)
                    times.append((time.perf_counter() - begin) * 1000)
                    assert reply.status_code == 200, reply.text
                print(f"{label:30s} median {statistics.median(times):6.1f} ms  worst {max(times):6.1f} ms  "
                      f"({len(reply.content)} bytes)")
            await anyio.Path(gate).touch()
            with anyio.fail_after(120):
                await d.client.wait(blocker)
            late = await _state_change_latency(d, http, web.at("/sse/jobs"), base / "gate2")
            print(f"SUCCEEDED on an open jobs page {late * 1000:.0f} ms after the daemon's event")


async def _state_change_latency(d: DaemonProc, http: httpx.AsyncClient, url: str, gate: Path) -> float:
    """Seconds from a new gated job's SUCCEEDED event (the daemon's clock) to the table saying so on an
    open jobs page's stream (the gate opens once the stream showed the job RUNNING)."""
    job_id = await d.client.submit(d.spec(task="tests.scripts.gated:make_task", steps=2, options={"gate": str(gate)}))
    running = f'id=\\"job-{job_id}\\" data-job=\\"{job_id}\\" data-state=\\"RUNNING\\"'
    needle = f'id=\\"job-{job_id}\\" data-job=\\"{job_id}\\" data-state=\\"SUCCEEDED\\"'
    with anyio.fail_after(120):
        async with http.stream("GET", url) as reply:
            opened = False
            async for line in reply.aiter_lines():
                if running in line and not opened:
                    opened = True
                    await anyio.Path(gate).touch()
                if needle in line:
                    arrived = time.time()
                    break
        event = await d.wait_event(job_id, lambda e: e.kind == "job.state_changed" and e.data.get("to") == "SUCCEEDED")
    return arrived - event.ts


if __name__ == "__main__":
    anyio.run(main, int(sys.argv[1]) if len(sys.argv) > 1 else 1000)
