"""Notification hooks in process: which hooks a job has, what they are told, and one bounded run of a
hook (its exit status and stderr said, a hang cut off at its bound with its group gone)."""

from __future__ import annotations

import os
import resource
import select
from pathlib import Path

from ddpd.daemon.config import Config
from ddpd.daemon.contain.identity import Identity
from ddpd.daemon.queue.notifyhooks import PREFIX, Hook, hooks_of, notice_of, run_hook, sweep, variables
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
    assert run_hook(["/bin/sh", "-c", "exit 0"], env, me, 10, None) is None
    assert run_hook(["/bin/sh", "-c", "echo no route >&2; exit 3"], env, me, 10, None) == "exit status 3: no route"
    pid_file = tmp_path / "pid"
    hang = f"sleep 600 & echo $! > {pid_file}; wait"
    assert run_hook(["/bin/sh", "-c", hang], env, me, 0.5, None) == "did not finish within 0.5 s"
    assert exited(int(pid_file.read_text()), within=10)  # what it started in its group went with it
    assert run_hook(["/nonexistent/hook"], env, me, 10, None) == "cannot start it: No such file or directory"


def test_the_start_sweep_of_left_hook_cgroups_survives_running_out_of_descriptors(tmp_path: Path) -> None:
    """Bug: the sweep's listing raised EMFILE into the daemon's root task group, which ended the
    daemon (a user hoarding connections at its start could stop it)."""
    (tmp_path / f"{PREFIX}1").mkdir()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowest_free = os.dup(0)  # the limit bounds the descriptor's number: the next one would be this
    os.close(lowest_free)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))  # none to spare
    try:
        sweep(tmp_path)  # logged (notify.sweep_failed); nothing raised
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert (tmp_path / f"{PREFIX}1").is_dir()  # left for the next start's sweep
