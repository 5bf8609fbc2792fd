"""ddpd as a systemd service: sd_notify, socket activation, shutdown and reload, logs, metrics, probes.

Each test runs the real daemon as a subprocess; systemd's side (the notify socket, the activated
socket, the signals) is played by the test itself.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import anyio
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ddpd.client import AsyncClient
from ddpd.protocol import JobState
from ddpd.protocol.control import JobView

from ..conftest import (
    DAEMON_START_TIMEOUT,
    REPO,
    DaemonProc,
    assert_gone,
    assert_nothing_left,
    daemon_argv,
    start_daemon,
    stop_daemon,
)

pytestmark = pytest.mark.anyio

BIN = Path(sys.executable).parent
SLOW = "tests.tasks:slow"


# -- helpers ---------------------------------------------------------------------------------


class NotifyListener:
    """The systemd end of $NOTIFY_SOCKET: every datagram, split into fields, with its arrival time."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.messages: list[tuple[float, list[str]]] = []
        self._changed = anyio.Event()

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with await anyio.create_unix_datagram_socket(local_path=self.path) as sock:
            task_status.started()
            while True:
                data, _ = await sock.receive()
                self.messages.append((time.monotonic(), data.decode().split("\n")))
                self._changed.set()
                self._changed = anyio.Event()

    def fields(self) -> list[str]:
        return [f for _, fields in self.messages for f in fields]

    async def wait(self, match: Callable[[str], bool], timeout: float = 60) -> tuple[float, str]:
        """The first field (from the start) that matches, and when it arrived."""
        with anyio.fail_after(timeout):
            seen = 0
            while True:
                for at, fields in self.messages[seen:]:
                    for f in fields:
                        if match(f):
                            return at, f
                seen = len(self.messages)
                await self._changed.wait()

    async def wait_after(self, index: int, match: Callable[[str], bool], timeout: float = 60) -> str:
        """The first matching field among the messages from `index` on."""
        with anyio.fail_after(timeout):
            while True:
                for _, fields in self.messages[index:]:
                    for f in fields:
                        if match(f):
                            return f
                await self._changed.wait()


def _job_logs(d: DaemonProc, job_id: str) -> list[dict[str, Any]]:
    return [e for e in d.logs if e.get("job_id") == job_id]


def _kinds(lines: list[dict[str, Any]]) -> list[str]:
    return [str(e["event"]) for e in lines]


def _run(cmd: list[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)


async def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return await anyio.to_thread.run_sync(_run, list(args))


async def _stop(d: DaemonProc, jobs: list[JobView] | None = None) -> None:
    if jobs is None and d.proc.returncode is None:
        with anyio.fail_after(30):
            jobs = await d.client.list_jobs()
    assert await stop_daemon(d) == 0
    assert_nothing_left(jobs or [])


async def _http_get(port: int, path: str, headers: str = "") -> tuple[int, str]:
    with anyio.fail_after(30):
        async with await anyio.connect_tcp("127.0.0.1", port) as stream:
            await stream.send(f"GET {path} HTTP/1.0\r\nHost: x\r\n{headers}\r\n".encode())
            chunks = []
            try:
                while True:
                    chunks.append(await stream.receive())
            except anyio.EndOfStream:
                pass
    head, _, body = b"".join(chunks).decode().partition("\r\n\r\n")
    return int(head.split()[1]), body


def _sample(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no sample {name} in:\n{text}")


# -- sd_notify ---------------------------------------------------------------------------------


async def test_notify_ready_status_watchdog_and_stopping(short_tmp: Path) -> None:
    notify = NotifyListener(short_tmp / "notify")
    async with anyio.create_task_group() as tg:
        await tg.start(notify.run)
        # WATCHDOG_USEC=0.4 s: pings every 0.2 s; one CPU slot so a second job has to queue
        d = await start_daemon(tg, short_tmp, "--cpu-slots", "1",
                               env={"NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": "400000"})
        ready_at, _ = await notify.wait(lambda f: f == "READY=1")
        # READY comes once the socket listens and recovery is done: the ready log line is already out
        assert any(e.get("event") == "daemon.ready" for e in d.logs)
        await notify.wait(lambda f: f == "STATUS=0 running, 0 queued")

        # the watchdog: 10 pings after READY, not faster than every 0.2 s nor much slower
        pings: list[float] = []
        with anyio.fail_after(60):
            while len(pings) < 10:
                pings = [at for at, fields in notify.messages if "WATCHDOG=1" in fields and at >= ready_at]
                if len(pings) < 10:
                    await notify.wait_after(len(notify.messages), lambda f: f == "WATCHDOG=1")
        span = pings[9] - pings[0]
        assert 9 * 0.2 * 0.8 <= span <= 9 * 0.2 * 4, f"9 watchdog intervals took {span:.2f}s"

        # STATUS follows every change of the counts
        spec = d.spec(task=SLOW, nproc=1, steps=10_000, options={"step_sleep": 0.02})
        first = await d.client.submit(spec)
        await notify.wait(lambda f: f == "STATUS=1 running, 0 queued")
        second = await d.client.submit(spec)
        await notify.wait(lambda f: f == "STATUS=1 running, 1 queued")
        view = await d.client.status(first)
        for rank in view.ranks:  # no worker inherits the daemon's systemd variables
            assert rank.pid is not None
            environ = (await anyio.Path(f"/proc/{rank.pid}/environ").read_bytes()).split(b"\0")
            assert not any(v.startswith((b"NOTIFY_SOCKET=", b"WATCHDOG_")) for v in environ)
        mark = len(notify.messages)
        await d.client.cancel(second)
        await d.client.cancel(first)
        await notify.wait_after(mark, lambda f: f == "STATUS=0 running, 0 queued")

        # a reload (SIGHUP, as `systemctl reload` sends it) is bracketed by RELOADING=1 and READY=1
        mark = len(notify.messages)
        d.proc.send_signal(signal.SIGHUP)
        await notify.wait_after(mark, lambda f: f == "RELOADING=1")
        await notify.wait_after(mark, lambda f: f == "READY=1")
        assert any(f.startswith("MONOTONIC_USEC=") for f in notify.fields())

        mark = len(notify.messages)
        jobs = await d.client.list_jobs()
        await _stop(d, jobs)
        await notify.wait_after(mark, lambda f: f == "STOPPING=1", timeout=10)
        assert notify.fields().count("READY=1") == 2
        tg.cancel_scope.cancel()


# -- socket activation -------------------------------------------------------------------------


async def _start_activated(tg: anyio.abc.TaskGroup, base: Path, listen_pid: str = "$$") -> tuple[DaemonProc, Path]:
    """Like systemd: a listening socket as fd 3, LISTEN_FDS=1 and LISTEN_PID set by the exec wrapper."""
    activated = base / "activated.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(activated))
        sock.listen(16)
        fd = sock.fileno()
        own = base / "own.sock"  # what the daemon would bind if it did not adopt the socket
        argv = " ".join(daemon_argv(own, base / "state"))
        script = f"exec 3<&{fd} {fd}<&-; LISTEN_PID={listen_pid} LISTEN_FDS=1 LISTEN_FDNAMES=ddpd.socket exec {argv}"
        proc = await anyio.open_process(["bash", "-c", script], stdin=subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL, pass_fds=[fd], cwd=str(REPO))
    finally:
        sock.close()  # the daemon holds its own copy now
    d = DaemonProc(socket=activated, state_dir=base / "state", proc=proc, client=AsyncClient(activated))
    tg.start_soon(d._pump)
    await d.wait_log(lambda e: e.get("event") == "daemon.ready", DAEMON_START_TIMEOUT)
    return d, own


async def test_socket_activation_adopts_the_passed_socket(short_tmp: Path) -> None:
    async with anyio.create_task_group() as tg:
        d, own = await _start_activated(tg, short_tmp)
        ready = next(e for e in d.logs if e.get("event") == "daemon.ready")
        assert ready["socket_activated"] is True
        assert ready["socket"] == str(d.socket)
        assert ready["pid"] == d.proc.pid
        assert not own.exists(), "the daemon bound its own socket although one was passed"
        job = await d.run(d.spec(task="two-layer", nproc=2, steps=3))
        assert job.state == JobState.SUCCEEDED, job.root_cause
        info = await d.client.daemon_info()
        assert info.socket == str(d.socket)
        await _stop(d, [job])
        # the socket belongs to systemd (ddpd.socket): the daemon leaves it in place
        assert d.socket.exists()
        tg.cancel_scope.cancel()


async def test_socket_of_another_pid_is_not_adopted(short_tmp: Path) -> None:
    """LISTEN_PID names another process (the variables leaked from a parent): bind our own socket."""
    async with anyio.create_task_group() as tg:
        d, own = await _start_activated(tg, short_tmp, listen_pid="1")
        ready = next(e for e in d.logs if e.get("event") == "daemon.ready")
        assert ready["socket_activated"] is False
        assert ready["socket"] == str(own)
        d.client = AsyncClient(own)
        assert await d.client.ping() > 0
        await _stop(d, [])
        assert not own.exists()
        tg.cancel_scope.cancel()


# -- shutdown ----------------------------------------------------------------------------------


async def test_sigterm_checkpoints_requeues_and_resumes_after_restart(short_tmp: Path) -> None:
    async with anyio.create_task_group() as tg:
        d = await start_daemon(tg, short_tmp, "--cpu-slots", "2")
        # a generous grace: even on a loaded machine the ranks stop at a step boundary, unsignalled
        running_id = await d.client.submit(d.spec(task=SLOW, nproc=2, steps=80, options={"step_sleep": 0.05},
                                                  timeouts={"kill_grace": 30.0}))
        await d.wait_event(running_id, lambda e: e.kind == "rank.progress" and e.data["step"] >= 3)
        queued_id = await d.client.submit(d.spec(task="two-layer", nproc=1, steps=3))  # no slot free: waits
        before = await d.client.list_jobs()

        assert await stop_daemon(d, signal.SIGTERM) == 0
        assert_nothing_left(before)
        lines = _job_logs(d, running_id)
        kinds = _kinds(lines)
        assert "job.stop_requested" in kinds
        checkpoint = next(e for e in lines if e["event"] == "job.checkpointed")
        requeued = [e for e in lines if e["event"] == "job.state_changed" and e["to"] == "QUEUED"]
        assert [(e["from"], e["reason"]) for e in requeued] == [("RUNNING", "daemon_shutdown")]
        assert "job.teardown" not in kinds, "the job stopped at a step boundary; no signal was needed"
        assert "job.finished" not in kinds
        assert _kinds(_job_logs(d, queued_id)) == ["job.submitted"]
        stopping = [e["event"] for e in d.logs if str(e.get("event", "")).startswith("daemon.")]
        assert stopping[-3:] == ["daemon.stop_requested", "daemon.stopping", "daemon.stopped"]

        # the daemon returns: both jobs run from the queue, the first from its checkpoint
        d2 = await start_daemon(tg, short_tmp)
        progress = await d2.wait_event(running_id, lambda e: e.kind == "rank.progress")
        assert progress.data["step"] > checkpoint["step"], (progress, checkpoint)
        with anyio.fail_after(120):
            resumed = await d2.client.wait(running_id)
            other = await d2.client.wait(queued_id)
        assert resumed.state == JobState.SUCCEEDED and resumed.attempt == 2, resumed
        assert all(r.step == 80 for r in resumed.ranks)
        assert other.state == JobState.SUCCEEDED and other.attempt == 1
        await _stop(d2)
        tg.cancel_scope.cancel()


async def test_second_sigterm_forces_the_teardown(short_tmp: Path) -> None:
    async with anyio.create_task_group() as tg:
        d = await start_daemon(tg, short_tmp)
        # one step takes 60 s and the grace is 60 s: only a forced teardown ends this quickly
        spec = d.spec(task=SLOW, nproc=2, steps=5, options={"step_sleep": 60.0}, timeouts={"kill_grace": 60.0})
        job_id = await d.client.submit(spec)
        await d.wait_event(job_id, lambda e: e.kind == "job.state_changed" and e.data.get("to") == "RUNNING")
        before = await d.client.list_jobs()
        d.proc.send_signal(signal.SIGTERM)
        await d.wait_log(lambda e: e.get("event") == "job.stop_requested" and e.get("job_id") == job_id)
        started = time.monotonic()
        d.proc.send_signal(signal.SIGINT)
        with anyio.fail_after(30):
            assert await d.proc.wait() == 0
        assert time.monotonic() - started < 20
        assert_nothing_left(before)
        forced = [e for e in d.logs if e.get("event") == "daemon.stop_requested"]
        assert [(e["signal"], e["force"]) for e in forced] == [("SIGTERM", False), ("SIGINT", True)]
        requeued = [e for e in _job_logs(d, job_id) if e["event"] == "job.state_changed" and e["to"] == "QUEUED"]
        assert len(requeued) == 1 and requeued[0]["reason"] == "daemon_shutdown"
        tg.cancel_scope.cancel()


async def test_submissions_are_refused_while_stopping(short_tmp: Path) -> None:
    async with anyio.create_task_group() as tg:
        d = await start_daemon(tg, short_tmp)
        spec = d.spec(task=SLOW, nproc=1, steps=5, options={"step_sleep": 60.0}, timeouts={"kill_grace": 60.0})
        job_id = await d.client.submit(spec)
        await d.wait_event(job_id, lambda e: e.kind == "job.state_changed" and e.data.get("to") == "RUNNING")
        before = await d.client.list_jobs()
        d.proc.send_signal(signal.SIGTERM)
        await d.wait_log(lambda e: e.get("event") == "daemon.stopping")
        result = await _cli(str(BIN / "ddpctl"), "--socket", str(d.socket), "submit", "--task", "two-layer")
        assert result.returncode != 0
        assert "shutting down" in result.stderr + result.stdout
        d.proc.send_signal(signal.SIGTERM)
        with anyio.fail_after(30):
            assert await d.proc.wait() == 0
        assert_nothing_left(before)
        tg.cancel_scope.cancel()


# -- reload ------------------------------------------------------------------------------------


async def test_sighup_and_ddpctl_reload_change_the_log_level(short_tmp: Path) -> None:
    config = short_tmp / "ddpd.toml"
    config.write_text('log_level = "info"\n')
    ddpctl = str(BIN / "ddpctl")
    async with anyio.create_task_group() as tg:
        d = await start_daemon(tg, short_tmp, "--config", str(config))
        spec = d.spec(task="two-layer", nproc=1, steps=2)
        a = await d.run(spec)
        assert not any(e.get("level") == "debug" for e in d.logs)

        config.write_text('log_level = "debug"\n[defaults]\nkill_grace = 3.0\n')
        d.proc.send_signal(signal.SIGHUP)
        reloaded = await d.wait_log(lambda e: e.get("event") == "daemon.reloaded" and e["log_level"] == "debug")
        assert reloaded["changed"] == ["defaults", "log_level"]
        b = await d.run(spec)
        await d.wait_log(lambda e: e.get("event") == "daemon.status" and e.get("level") == "debug")

        config.write_text('log_level = "warning"\n')
        result = await _cli(ddpctl, "--socket", str(d.socket), "reload")
        assert result.returncode == 0, result.stderr
        quiet = await d.wait_log(lambda e: e.get("event") == "daemon.reloaded" and e["log_level"] == "warning")
        assert quiet["level"] == "warning"  # a reload always shows, whatever the new level hides
        c = await d.run(spec)
        config.write_text('log_level = "info"\n')
        d.proc.send_signal(signal.SIGHUP)  # a barrier: every line about job c came before this one
        await d.wait_log(lambda e: e.get("event") == "daemon.reloaded" and e["log_level"] == "info")
        assert _job_logs(d, c.id) == [], "info lines were logged at level warning"
        assert "job.finished" in _kinds(_job_logs(d, b.id))

        config.write_text('log_level = "loud"\n')  # a bad file: an error, the old config stays
        result = await _cli(ddpctl, "--socket", str(d.socket), "reload")
        assert result.returncode != 0
        await d.wait_log(lambda e: e.get("event") == "daemon.reload_failed")
        assert (await d.run(spec)).state == JobState.SUCCEEDED
        await _stop(d)
        assert all(j.state == JobState.SUCCEEDED for j in (a, b, c))
        tg.cancel_scope.cancel()


# -- logs --------------------------------------------------------------------------------------


def _check_line(line: dict[str, Any]) -> None:
    assert line.get("event") != "raw", f"not a JSON line: {line}"
    assert line["level"] in ("debug", "info", "warning", "error")
    stamp = line["timestamp"]
    assert stamp.endswith("Z"), stamp
    assert datetime.fromisoformat(stamp.replace("Z", "+00:00")).utcoffset() is not None


async def test_logs_of_a_job_are_json_lines_with_the_documented_events(daemon: DaemonProc) -> None:
    job = await daemon.run(daemon.spec(task="two-layer", nproc=2, steps=5))
    assert job.state == JobState.SUCCEEDED
    await daemon.wait_log(lambda e: e.get("event") == "job.finished" and e.get("job_id") == job.id)
    for line in daemon.logs:
        _check_line(line)
    lines = _job_logs(daemon, job.id)
    for line in lines:  # always bound with job id, attempt and rank (null when not about one rank)
        assert {"job_id", "attempt", "rank"} <= line.keys(), line
    kinds = _kinds(lines)
    per_job = ["job.submitted", "job.rendezvous", "job.torn_down", "job.finished"]
    per_rank = ["rank.spawned", "rank.connected", "rank.store_connected", "rank.joined", "rank.result",
                "rank.exited"]
    for kind in per_job:
        assert kinds.count(kind) == 1, (kind, kinds)
    for kind in per_rank:
        assert sorted(e["rank"] for e in lines if e["event"] == kind) == [0, 1], (kind, kinds)
    assert kinds[0] == "job.submitted" and kinds[-1] == "job.finished"
    by = {(e["event"], e["rank"]): e for e in lines}
    pids = {r.rank: r.pid for r in job.ranks}
    for r in (0, 1):
        assert by["rank.spawned", r]["pid"] == pids[r] and by["rank.spawned", r]["pgid"] == pids[r]  # its own
        assert by["rank.joined", r]["seconds"] > 0
        assert by["rank.exited", r]["exit_code"] == 0 and by["rank.exited", r]["signal"] is None
        assert by["rank.spawned", r]["attempt"] == 1
    changes = [(e["from"], e["to"]) for e in lines if e["event"] == "job.state_changed"]
    assert changes == [("QUEUED", "STARTING"), ("STARTING", "RUNNING"), ("RUNNING", "SUCCEEDED")]
    assert all("reason" in e for e in lines if e["event"] == "job.state_changed")
    finished = by["job.finished", None]
    assert finished["state"] == "SUCCEEDED" and finished["attempts"] == 1 and finished["duration"] > 0
    assert finished["root_cause"] is None and finished["rank"] is None


async def test_worker_failure_and_missed_heartbeats_reach_the_log(short_tmp: Path) -> None:
    async with anyio.create_task_group() as tg:
        d = await start_daemon(tg, short_tmp, "--heartbeat-interval", "0.3")
        failed = await d.run(d.spec(task="tests.tasks:fail_at_step", nproc=2, options={"rank": 1, "at_step": 2}))
        assert failed.state == JobState.FAILED
        await d.wait_log(lambda e: e.get("event") == "job.finished" and e.get("job_id") == failed.id)
        line = next(e for e in _job_logs(d, failed.id) if e["event"] == "rank.failed")
        assert line["level"] == "warning" and line["rank"] == 1
        assert line["error"] == "RuntimeError" and line["message"] == "injected failure"
        assert "injected failure" in line["traceback"] and "Traceback" in line["traceback"]
        finished = next(e for e in _job_logs(d, failed.id) if e["event"] == "job.finished")
        assert finished["root_cause_rank"] == 1 and "injected failure" in finished["root_cause"]

        # a rank that stops sending anything (SIGSTOP): a warning long before the timeout
        spec = d.spec(task=SLOW, nproc=2, steps=10_000, options={"step_sleep": 0.02},
                      timeouts={"heartbeat": 120.0})
        job_id = await d.client.submit(spec)
        await d.wait_event(job_id, lambda e: e.kind == "rank.progress" and e.data["step"] >= 2)
        view = await d.client.status(job_id)
        victim = view.ranks[1].pid
        assert victim is not None
        mark = len(d.logs)
        os.kill(victim, signal.SIGSTOP)
        try:
            missed = await d.wait_log(lambda e: e.get("event") == "rank.heartbeat_missed"
                                      and e.get("job_id") == job_id and e.get("rank") == 1
                                      and d.logs.index(e) >= mark)
        finally:
            os.kill(victim, signal.SIGCONT)
        # (on a loaded machine other ranks may be a little late too: a warning, nothing more)
        assert missed["level"] == "warning" and missed["attempt"] == 1 and missed["interval"] == 0.3
        assert 0.6 <= missed["silent"] < 120.0
        await d.client.cancel(job_id)
        with anyio.fail_after(60):
            job = await d.client.wait(job_id)
        await d.wait_log(lambda e: e.get("event") == "job.finished" and e.get("job_id") == job_id)
        assert job.state == JobState.CANCELLED
        await _stop(d, [failed, job])
        tg.cancel_scope.cancel()


# -- metrics and probes ------------------------------------------------------------------------


async def test_metrics_endpoint(short_tmp: Path) -> None:
    config = short_tmp / "ddpd.toml"
    config.write_text('metrics_token = "s3cret"\n')
    async with anyio.create_task_group() as tg:
        d = await start_daemon(tg, short_tmp, "--config", str(config), "--metrics-listen", "127.0.0.1:0")
        port = next(e for e in d.logs if e.get("event") == "metrics.listening")["port"]
        auth = "Authorization: Bearer s3cret\r\n"
        assert (await _http_get(port, "/metrics"))[0] == 401
        assert (await _http_get(port, "/metrics", "Authorization: Bearer nope\r\n"))[0] == 401
        assert (await _http_get(port, "/other", auth))[0] == 404

        job_id = await d.client.submit(d.spec(task=SLOW, nproc=2, steps=10_000, options={"step_sleep": 0.02}))
        await d.wait_event(job_id, lambda e: e.kind == "rank.progress" and e.data["step"] >= 2)
        status, text = await _http_get(port, "/metrics", auth)
        assert status == 200
        assert _sample(text, 'ddpd_jobs{state="RUNNING"}') == 1
        assert _sample(text, 'ddpd_ranks{state="TRAINING"}') == 2
        assert _sample(text, "ddpd_launch_seconds_count") == 1
        series = {(s.name, tuple(sorted(s.labels.items()))): s.value
                  for family in text_string_to_metric_families(text) for s in family.samples}
        age = series[("ddpd_rank_heartbeat_age_seconds", (("attempt", "1"), ("job_id", job_id), ("rank", "1")))]
        assert 0 <= age < 60
        assert series[("ddpd_job_step", (("job_id", job_id),))] >= 2
        assert ("ddpd_job_loss", (("job_id", job_id),)) in series
        for rank in ("0", "1"):
            labels = (("attempt", "1"), ("job_id", job_id), ("rank", rank))
            assert series[("ddpd_rank_resident_memory_bytes", labels)] > 10 * 2**20  # torch is loaded
            assert series[("ddpd_rank_cpu_seconds_total", labels)] > 0
        assert series[("process_resident_memory_bytes", ())] > 0
        await d.client.cancel(job_id)
        with anyio.fail_after(60):
            job = await d.client.wait(job_id)
        await d.wait_log(lambda e: e.get("event") == "job.finished" and e.get("job_id") == job_id)
        text = (await _http_get(port, "/metrics", auth))[1]
        assert _sample(text, 'ddpd_jobs{state="CANCELLED"}') == 1
        assert _sample(text, 'ddpd_jobs_finished_total{state="CANCELLED"}') == 1
        assert _sample(text, "ddpd_teardown_seconds_count") == 1
        assert _sample(text, 'ddpd_cpu_slots{kind="free"}') == _sample(text, 'ddpd_cpu_slots{kind="total"}')
        assert "# TYPE ddpd_launch_seconds histogram" in text
        await _stop(d, [job])
        tg.cancel_scope.cancel()


async def test_metrics_are_off_by_default(daemon: DaemonProc) -> None:
    assert not any(e.get("event") == "metrics.listening" for e in daemon.logs)


async def test_health_ping_and_daemon_info(short_tmp: Path) -> None:
    ddpd, ddpctl = str(BIN / "ddpd"), str(BIN / "ddpctl")
    async with anyio.create_task_group() as tg:
        d = await start_daemon(tg, short_tmp)
        sock = str(d.socket)
        health = await _cli(ddpd, "health", "--socket", sock)
        assert (health.returncode, health.stdout.strip()) == (0, "ok")
        ping = await _cli(ddpctl, "--socket", sock, "ping")
        assert ping.returncode == 0 and "pong" in ping.stdout
        info = await _cli(ddpctl, "--socket", sock, "daemon", "-o", "json")
        assert info.returncode == 0, info.stderr
        data = json.loads(info.stdout)
        assert data["pid"] == d.proc.pid and data["version"] and data["uptime"] > 0
        assert {"running", "queued", "cpu_slots", "gpus"} <= data.keys()
        await _stop(d, [])
        pid = d.proc.pid
        health = await _cli(ddpd, "health", "--socket", sock, "--timeout", "2")
        assert health.returncode == 1 and "unhealthy" in health.stderr
        assert_gone(pid)
        tg.cancel_scope.cancel()


# -- unit files --------------------------------------------------------------------------------

SYSTEMD = REPO / "systemd"


def _directives(path: Path) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith(("#", "[")) and "=" in line:
            key, _, value = line.partition("=")
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def test_unit_files_say_what_the_service_needs() -> None:
    service = _directives(SYSTEMD / "ddpd.service")
    for key, value in {"Type": "notify", "NotifyAccess": "main", "Restart": "on-failure", "KillMode": "mixed",
                       "RuntimeDirectory": "ddpd", "StateDirectory": "ddpd", "LogsDirectory": "ddpd",
                       "DevicePolicy": "closed", "Delegate": "yes", "ProtectControlGroups": "no",
                       "StateDirectoryMode": "0711", "UMask": "0077", "NoNewPrivileges": "yes"}.items():
        assert service.get(key) == [value], key
    # root, so that each rank runs as its submitter (docs/identity.md)
    assert "User" not in service and "Group" not in service
    assert {"CAP_SETUID", "CAP_SETGID", "CAP_KILL"} <= set(service["CapabilityBoundingSet"][0].split())
    assert "PrivateDevices" not in service  # it would hide /dev/nvidia*
    assert "char-nvidia-frontend rw" in service["DeviceAllow"]
    assert int(service["WatchdogSec"][0]) >= 10
    # above the longest shutdown with the default kill grace (5 s): stop + SIGTERM + SIGKILL waits
    assert int(service["TimeoutStopSec"][0]) > 3 * 5 + 5
    sock = _directives(SYSTEMD / "ddpd.socket")
    assert sock["SocketMode"] == ["0660"] and sock["SocketGroup"] == ["ddpd"]
    assert sock["ListenStream"] == ["/run/ddpd/ddpd.sock"]
    assert "ddpd" in (SYSTEMD / "ddpd.sysusers.conf").read_text()
    assert "/etc/ddpd/ddpd.toml" in (SYSTEMD / "ddpd.tmpfiles.conf").read_text()


def test_example_config_parses(short_tmp: Path) -> None:
    from ddpd.daemon.config import load_config

    text = (SYSTEMD / "ddpd.toml").read_text()
    uncommented = "\n".join(line[1:] if re.match(r"#(\w+ = |\[defaults\])", line) else line
                            for line in text.splitlines())
    path = short_tmp / "ddpd.toml"
    path.write_text(uncommented.replace('"..."', '"token"'))
    cfg = load_config(path)
    assert cfg.metrics_listen == "127.0.0.1:9464" and cfg.defaults.kill_grace == 5.0


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze is not installed (apt-get install systemd)")
def test_systemd_analyze_verify(short_tmp: Path) -> None:
    # verify checks that ExecStart exists: point it at this checkout's ddpd
    service = (SYSTEMD / "ddpd.service").read_text().replace("/opt/ddpd/bin/ddpd", str(BIN / "ddpd"))
    (short_tmp / "ddpd.service").write_text(service)
    shutil.copy(SYSTEMD / "ddpd.socket", short_tmp / "ddpd.socket")
    units = [str(short_tmp / "ddpd.service"), str(short_tmp / "ddpd.socket")]
    result = _run(["systemd-analyze", "verify", *units])
    assert result.returncode == 0, result.stderr
    # unknown keys and bad values are only warnings: there must be none about our files
    ours = [line for line in result.stderr.splitlines() if str(short_tmp) in line]
    assert ours == [], "\n".join(ours)
