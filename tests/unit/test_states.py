"""The job and rank state machines: the legal transitions, and a repeated join told apart."""

from __future__ import annotations

import itertools

import pytest

from ddpd.protocol import JobState, RankState, TransitionError, check_job_transition, check_rank_transition
from ddpd.protocol.states import is_rejoin

R = RankState


def test_rank_states_move_forward_skipping_allowed() -> None:
    order = [R.SPAWNED, R.CONNECTED, R.STORE_CONNECTED, R.JOINED, R.TRAINING, R.EXITED]
    for old, new in itertools.pairwise(order):
        assert check_rank_transition(old, new) is new
    assert check_rank_transition(R.SPAWNED, R.EXITED) is R.EXITED
    assert check_rank_transition(R.CONNECTED, R.JOINED) is R.JOINED
    assert check_rank_transition(R.TRAINING, R.TRAINING) is R.TRAINING


@pytest.mark.parametrize(("old", "new"), [
    (R.JOINED, R.STORE_CONNECTED), (R.TRAINING, R.JOINED), (R.JOINED, R.JOINED), (R.CONNECTED, R.SPAWNED),
    (R.EXITED, R.EXITED), (R.EXITED, R.TRAINING),
])
def test_rank_states_never_go_back(old: RankState, new: RankState) -> None:
    with pytest.raises(TransitionError, match=f"{old} -> {new}"):
        check_rank_transition(old, new)


def test_a_second_init_process_group_is_a_rejoin_not_a_transition() -> None:
    for old in (R.STORE_CONNECTED, R.JOINED, R.TRAINING):
        assert is_rejoin(old, R.STORE_CONNECTED)
    for old in (R.JOINED, R.TRAINING):
        assert is_rejoin(old, R.JOINED)
    # the first join is a transition, and nothing comes after the exit
    assert not is_rejoin(R.CONNECTED, R.STORE_CONNECTED)
    assert not is_rejoin(R.STORE_CONNECTED, R.JOINED)
    assert not is_rejoin(R.SPAWNED, R.JOINED)
    assert not is_rejoin(R.EXITED, R.JOINED)
    assert not is_rejoin(R.JOINED, R.TRAINING)


def test_final_job_states_are_final() -> None:
    assert check_job_transition(JobState.RUNNING, JobState.SUCCEEDED) is JobState.SUCCEEDED
    for final in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED, JobState.TIMED_OUT):
        assert final.final
        with pytest.raises(TransitionError):
            check_job_transition(final, JobState.RUNNING)
