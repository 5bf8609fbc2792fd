"""Job-state decisions as pure logic: after an attempt, after a daemon restart, retention and removal."""

from __future__ import annotations

import pytest

from ddpd.daemon.run import lifecycle
from ddpd.daemon.run.outcome import AttemptEnd, Outcome, settle_stop
from ddpd.protocol import JobState

S = JobState
E = AttemptEnd


def after(outcome: AttemptEnd, reason: str = "rank_failed", *, attempt: int = 1, max_restarts: int = 0,
          cancel: bool = False, accepting: bool = True) -> JobState:
    return lifecycle.after_attempt(outcome, reason, attempt=attempt, max_restarts=max_restarts,
                                   cancel_requested=cancel, accepting=accepting)


@pytest.mark.parametrize(("outcome", "final"), [(E.FAILED, S.FAILED), (E.TIMED_OUT, S.TIMED_OUT)])
def test_failure_restarts_while_restarts_remain(outcome: AttemptEnd, final: JobState) -> None:
    assert after(outcome, attempt=1, max_restarts=2) is S.RESTARTING
    assert after(outcome, attempt=2, max_restarts=2) is S.RESTARTING
    assert after(outcome, attempt=3, max_restarts=2) is final


def test_no_restart_without_max_restarts() -> None:
    assert after(E.FAILED) is S.FAILED


def test_wall_time_never_restarts() -> None:
    assert after(E.TIMED_OUT, "wall_time", max_restarts=5) is S.TIMED_OUT


def test_cancel_never_restarts() -> None:
    assert after(E.FAILED, max_restarts=5, cancel=True) is S.FAILED
    assert after(E.CANCELLED, "cancelled by uid 0", max_restarts=5, cancel=True) is S.CANCELLED


def test_shutdown_requeues_and_blocks_restarts() -> None:
    assert after(E.DAEMON_STOPPING, "daemon_shutdown", max_restarts=5) is S.QUEUED
    assert after(E.FAILED, max_restarts=5, accepting=False) is S.FAILED


def test_re_forming_nodes_restart_even_without_restarts_left() -> None:
    assert after(E.REFORMING, "membership_change", attempt=9, max_restarts=0) is S.RESTARTING


def test_every_end_leads_to_a_state() -> None:
    assert {after(end) for end in AttemptEnd} == {S.SUCCEEDED, S.FAILED, S.TIMED_OUT, S.CANCELLED, S.QUEUED,
                                                  S.RESTARTING, S.PREEMPTED}


def test_a_preempted_job_is_queued_again_without_spending_a_restart() -> None:
    assert after(E.PREEMPTED, "preempted by j9", attempt=3, max_restarts=0, cancel=True) is S.PREEMPTED
    assert lifecycle.after_preemption(S.PREEMPTED) is S.QUEUED
    assert lifecycle.after_preemption(S.RUNNING) is None
    # a daemon restart between PREEMPTED and QUEUED: queued, whatever restarts are left
    assert lifecycle.after_daemon_restart(S.PREEMPTED, attempt=5, max_restarts=0) is S.QUEUED


def test_success_is_final() -> None:
    assert after(E.SUCCEEDED, "all ranks succeeded", max_restarts=5) is S.SUCCEEDED


@pytest.mark.parametrize("state", [S.STARTING, S.RUNNING, S.RESTARTING])
def test_recovery_requeues_while_a_restart_is_left(state: JobState) -> None:
    assert lifecycle.after_daemon_restart(state, attempt=1, max_restarts=1) is S.QUEUED
    assert lifecycle.after_daemon_restart(state, attempt=2, max_restarts=1) is S.FAILED
    assert lifecycle.after_daemon_restart(state, attempt=1, max_restarts=0) is S.FAILED


@pytest.mark.parametrize("state", [S.QUEUED, S.SUCCEEDED, S.FAILED, S.CANCELLED, S.TIMED_OUT])
def test_recovery_leaves_queued_and_ended_jobs(state: JobState) -> None:
    assert lifecycle.after_daemon_restart(state, attempt=1, max_restarts=3) is None


def test_running_once_every_rank_joined() -> None:
    assert lifecycle.when_joined(S.STARTING, 1, 2) is None
    assert lifecycle.when_joined(S.STARTING, 2, 2) is S.RUNNING
    assert lifecycle.when_joined(S.RUNNING, 2, 2) is None


def test_removal_only_of_ended_jobs() -> None:
    assert lifecycle.removal_refused(S.CANCELLED) is None
    refused = lifecycle.removal_refused(S.RUNNING)
    assert refused is not None and "RUNNING" in refused


@pytest.mark.parametrize("stop", [AttemptEnd.PREEMPTED, AttemptEnd.DAEMON_STOPPING, AttemptEnd.CANCELLED])
def test_a_task_that_finished_its_last_step_while_asked_to_stop_succeeded(stop: AttemptEnd) -> None:
    """Bug (found by 50 preemptions in a row): a preemption asked for as the job made its last step was
    recorded PREEMPTED and the finished job queued to run again; a daemon stop would requeue it too."""
    asked = Outcome(stop, "asked", graceful=True)
    done = Outcome(AttemptEnd.SUCCEEDED, "all ranks succeeded")
    assert settle_stop(asked, done, script=False) is done
    assert settle_stop(asked, None, script=False) is asked  # a rank not done (or stopped early)
    assert settle_stop(asked, done, script=True) is asked  # a script's clean exit does not say it finished
    failed = Outcome(AttemptEnd.FAILED, "rank_failed")
    assert settle_stop(failed, done, script=False) is failed
