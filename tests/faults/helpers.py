"""Helpers of the fault suite: timings per fault, proof that processes are gone, events of a job."""

from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path

import anyio

from ddpd.daemon.contain.procs import wait_gone
from ddpd.protocol.control import EventView, JobView

from ..conftest import DaemonProc, assert_gone

PR_SET_CHILD_SUBREAPER = 36

TIMINGS: list[str] = []


def report_fault(name: str, fault_at: float, job: JobView) -> float:
    """Print (and keep for the session summary) the time from the fault to the job's final state."""
    assert job.finished_at is not None, job
    seconds = job.finished_at - fault_at
    line = f"FAULT {name}: {seconds:.2f} s to {job.state}"
    TIMINGS.append(line)
    print(line, flush=True)
    return seconds


def report_line(line: str) -> None:
    TIMINGS.append(line)
    print(line, flush=True)


def become_subreaper() -> None:
    """Orphans of a daemon killed with SIGKILL come to this test process (pid 1 here never reaps).

    Only the pids a test names are ever reaped (`await_gone`), so other children are untouched.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def _parent(pid: int) -> int | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(raw[raw.rindex(")") + 2 :].split()[1])


async def await_gone(pid: int, timeout: float) -> None:
    """Wait (bounded) until `pid` has exited, reap it if it was reparented to us, prove it is gone."""
    with anyio.fail_after(timeout):
        await wait_gone(pid)
    _reap(pid)
    assert_gone(pid)


def _reap(pid: int) -> None:
    """Reap `pid` if it is an exited orphan reparented to this process (never blocks)."""
    if _parent(pid) == os.getpid():
        os.waitpid(pid, os.WNOHANG)


def assert_alive_in_job(pid: int, job_id: str) -> None:
    """`pid` runs now (not a zombie) with the job's id in its environment: an orphan the test will
    prove reaped existed, and is the job's (a reused pid would not carry the id)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError as exc:
        raise AssertionError(f"process {pid} of job {job_id} is not there: {exc}") from None
    assert state != "Z", f"process {pid} of job {job_id} has exited already (a zombie)"
    assert f"DDPD_JOB_ID={job_id}".encode() in environ, f"process {pid} is not job {job_id}'s"


def child_pids(log_path: str) -> list[int]:
    """The pids a `spawn_children_reporting` rank printed into its log."""
    for line in Path(log_path).read_text().splitlines():
        if line.startswith("CHILD_PIDS "):
            return [int(p) for p in line.split()[1:]]
    raise AssertionError(f"no CHILD_PIDS line in {log_path}")


async def wait_rank_log(d: DaemonProc, job_id: str, rank: int, text: str, timeout: float = 120) -> None:
    """Follow a rank's log through the daemon until `text` appears (a handshake printed by a test task)."""
    seen = ""
    with anyio.fail_after(timeout):
        async with d.client.logs(job_id, rank=rank, follow=True) as chunks:
            async for chunk in chunks:
                seen += chunk.text
                if text in seen:
                    return
    raise AssertionError(f"rank {rank} of {job_id} never logged {text!r}")


async def events_of(d: DaemonProc, job_id: str) -> list[EventView]:
    async with d.client.events(job_id) as stream:
        return [e async for e in stream]


def now() -> float:
    return time.time()


class Pinger:
    """Pings the daemon every `every` seconds until stopped, each ping bounded by `bound`; keeps the worst."""

    def __init__(self, d: DaemonProc, bound: float = 2.0, every: float = 0.05) -> None:
        self.d, self.bound, self.every = d, bound, every
        self.worst = 0.0
        self.count = 0

    async def run(self, stop: anyio.Event) -> None:
        while not stop.is_set():
            with anyio.fail_after(self.bound):  # a frozen loop fails the test here
                self.worst = max(self.worst, await self.d.client.ping())
            self.count += 1
            with anyio.move_on_after(self.every):  # pacing, not ordering
                await stop.wait()


async def wait_while_pinging(d: DaemonProc, job_id: str, timeout: float = 60) -> tuple[JobView, Pinger]:
    """Wait for the job's end while a Pinger proves the daemon keeps answering; the job and the pinger."""
    pinger, done = Pinger(d), anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(pinger.run, done)
        with anyio.fail_after(timeout):
            job = await d.client.wait(job_id)
        done.set()
    return job, pinger
