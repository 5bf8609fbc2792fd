"""Notification hooks in process: which hooks a job has, what they are told, and one bounded run of a
hook (its exit status and stderr said, a hang cut off at its bound with its group gone)."""

from __future__ import annotations

import os
import resource
import select
import socket
import threading
from pathlib import Path

from ddpd.daemon.config import Config
from ddpd.daemon.contain.identity import Identity
from ddpd.daemon.contain.procs import Exit
from ddpd.daemon.contain.reaper import reap_inherited
from ddpd.daemon.queue.notifyhooks import (
    HOOKS,
    Hook,
    HookRun,
    hooks_of,
    http_status,
    notice_of,
    run_hook,
    variables,
)
from ddpd.daemon.store.records import Job, Rank
from ddpd.protocol import JobSpec, JobState, RankState
from ddpd.protocol.control import RootCause


def exited(pid: int, within: float) -> bool:
    """Whether the process has exited (a zombie counts), waiting at most `within` seconds on its pidfd."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], within)[0])
    finally:
        os.close(fd)


def _job(**spec: object) -> Job:
    job = Job(id="j7-abcd", seq=7, name="train", owner_uid=os.getuid(), spec=JobSpec(**spec),  # type: ignore[arg-type]
              state=JobState.FAILED, submitted_at=100.0)
    job.started_at, job.finished_at, job.attempt, job.reason = 110.0, 150.5, 2, "rank_failed"
    job.root_cause = RootCause(reason="rank_failed", detail="rank 1 failed: ValueError: bad batch")
    job.ranks = [Rank(rank=1, attempt=2, state=RankState.EXITED, loss=0.5),
                 Rank(rank=0, attempt=2, state=RankState.EXITED, loss=0.25)]
    return job


def test_a_jobs_hooks_are_its_own_then_the_daemons() -> None:
    job = _job(notify="echo hi", notify_url="https://example.org/h")
    cfg = Config(notify="logger ended", notify_url=None)
    assert hooks_of(job, cfg) == [Hook("command", "echo hi"), Hook("url", "https://example.org/h"),
                                  Hook("command", "logger ended")]
    assert hooks_of(_job(), Config()) == []


def test_a_hook_is_told_the_jobs_facts() -> None:
    told = variables(notice_of(_job(), "ended", now=200.0))
    assert told == {"DDPD_JOB_ID": "j7-abcd", "DDPD_JOB_NAME": "train", "DDPD_JOB_EVENT": "ended",
                    "DDPD_JOB_STATE": "FAILED", "DDPD_JOB_REASON": "rank_failed",
                    "DDPD_JOB_ROOT_CAUSE": "rank 1 failed: ValueError: bad batch", "DDPD_JOB_ATTEMPT": "2",
                    "DDPD_JOB_DURATION": "40.5", "DDPD_JOB_LAST_LOSS": "0.25",
                    "DDPD_JOB_CURVE": ""}  # rank 0's loss


def test_a_hooks_failure_is_said_and_a_hang_is_cut_off_with_its_group(tmp_path: Path) -> None:
    me = Identity.of(os.getuid())
    env = {"PATH": "/usr/bin:/bin"}
    assert run_hook(["/bin/sh", "-c", "exit 0"], env, me, 10, None) == HookRun(None, Exit(0, None))
    failed = run_hook(["/bin/sh", "-c", "echo no route >&2; exit 3"], env, me, 10, None)
    assert failed == HookRun("exit status 3: no route", Exit(3, None)) and failed.facts() == {"exit_code": 3}
    killed = run_hook(["/bin/sh", "-c", "kill -TERM $$"], env, me, 10, None)
    assert killed == HookRun("killed by SIGTERM", Exit(None, "SIGTERM")) and killed.facts() == {"signal": "SIGTERM"}
    pid_file = tmp_path / "pid"
    hang = f"sleep 600 & echo $! > {pid_file}; wait"
    assert run_hook(["/bin/sh", "-c", hang], env, me, 0.5, None) == HookRun("did not finish within 0.5 s")
    assert exited(int(pid_file.read_text()), within=10)  # what it started in its group went with it
    assert run_hook(["/nonexistent/hook"], env, me, 10, None) == HookRun("cannot start it: No such file or directory")


def test_a_hooks_exit_status_is_its_own_while_the_reaper_of_inherited_children_runs() -> None:
    """Bug (issue 34, finding 9): the hook's child was not registered with the reaper (it leads a
    process group of its own), the reaper reaped it first and `wait()` reported 0: a hook that exited
    3 was recorded as delivered."""
    me = Identity.of(os.getuid())
    stop = threading.Event()

    def reap() -> None:
        while not stop.is_set():
            reap_inherited()

    reaper = threading.Thread(target=reap)
    reaper.start()
    try:
        runs = [run_hook(["/bin/sh", "-c", "exit 3"], {"PATH": "/usr/bin:/bin"}, me, 10, None) for _ in range(20)]
    finally:
        stop.set()
        reaper.join(10)
    assert {r.error for r in runs} == {"exit status 3"}


def _answering(status: int) -> tuple[socket.socket, threading.Thread]:
    """A one-connection HTTP server on 127.0.0.1 that answers `status` (no body)."""
    server = socket.create_server(("127.0.0.1", 0))

    def answer() -> None:
        conn, _ = server.accept()
        with conn:
            conn.settimeout(10)
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            conn.sendall(f"HTTP/1.1 {status} X\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".encode())

    thread = threading.Thread(target=answer)
    thread.start()
    return server, thread


def test_a_url_hook_says_the_http_status_it_got(tmp_path: Path) -> None:
    me = Identity.of(os.getuid())
    env = {"PATH": "/usr/bin:/bin", "DDPD_NOTIFY_JSON": "{}"}
    for status, error in ((204, None), (503, "HTTP 503")):
        server, thread = _answering(status)
        url = f"http://127.0.0.1:{server.getsockname()[1]}/hook"
        try:
            ran = run_hook(Hook("url", url).argv(10), env, me, 10, None, answer=True)
        finally:
            thread.join(10)
            server.close()
        assert ran.http_status == status and ran.exit == Exit(0 if error is None else 1, None), ran
        assert ran.error is None if error is None else ran.error == f"exit status 1: POST {url}: {error}"
    with socket.create_server(("127.0.0.1", 0)) as closed:
        port = closed.getsockname()[1]
    ran = run_hook(Hook("url", f"http://127.0.0.1:{port}/").argv(10), env, me, 10, None, answer=True)
    assert ran.http_status is None and ran.exit == Exit(1, None) and "Connection refused" in (ran.error or "")


def test_only_a_status_line_of_three_digits_is_an_http_status() -> None:
    assert [http_status(b) for b in (b"204\n", b"503", b"99", b"600", b"2000", b"", b"x04", b" 200 ")] == [
        204, 503, None, None, None, None, None, 200]


def test_the_start_sweep_of_left_hook_cgroups_survives_running_out_of_descriptors(tmp_path: Path) -> None:
    """Bug: the sweep's listing raised EMFILE into the daemon's root task group, which ended the
    daemon (a user hoarding connections at its start could stop it)."""
    (tmp_path / f"{HOOKS.prefix}1").mkdir()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowest_free = os.dup(0)  # the limit bounds the descriptor's number: the next one would be this
    os.close(lowest_free)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))  # none to spare
    try:
        HOOKS.sweep(tmp_path)  # logged (notify.sweep_failed); nothing raised
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert (tmp_path / f"{HOOKS.prefix}1").is_dir()  # left for the next start's sweep
