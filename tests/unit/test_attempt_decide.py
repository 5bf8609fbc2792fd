"""The attempt's pure decisions on a rank's exit (attempt/decide.py) and its deadline timer (attempt/loop.py)."""

from __future__ import annotations

import subprocess
from typing import Any, cast

import anyio
import pytest

from ddpd.daemon.attempt.decide import exit_conclusion, exit_told
from ddpd.daemon.attempt.events import Event, TimerFired, open_events
from ddpd.daemon.attempt.loop import Timer
from ddpd.daemon.attempt.ranks import NOT_ALLOWED, STOPPING, RankHandle
from ddpd.daemon.contain.procs import Exit
from ddpd.daemon.run.clock import FakeClock
from ddpd.daemon.run.outcome import AttemptEnd
from ddpd.daemon.store.records import Rank
from ddpd.protocol import RankState
from ddpd.protocol.channel import Failure, Result


def _exited(exit_: Exit, result: Result | None = None, failure: Failure | None = None) -> RankHandle:
    h = RankHandle(rank=Rank(rank=1, attempt=1, state=RankState.TRAINING), proc=cast(subprocess.Popen[bytes], None),
                   channel=cast(Any, None))
    h.exit, h.result, h.failure = exit_, result, failure
    return h


def test_a_rank_that_succeeded_ends_nothing_and_its_exit_says_nothing_of_replacement() -> None:
    h = _exited(Exit(0, None), Result(steps=5))
    assert exit_conclusion(h, True, None, 1) is None
    assert exit_told(True, None) == {}


def test_a_lost_rank_being_replaced_does_not_end_the_attempt() -> None:
    h = _exited(Exit(None, "SIGKILL"))
    assert exit_conclusion(h, False, None, 1) is None
    assert exit_told(False, None) == {"hot_replace": "replacing"}


def test_a_lost_rank_not_replaced_fails_the_attempt_and_says_why_where_it_is_news() -> None:
    h = _exited(Exit(None, "SIGKILL"))
    why = "the rank was lost before training (JOINED)"
    outcome = exit_conclusion(h, False, why, 1)
    assert outcome is not None and (outcome.end, outcome.reason, outcome.root_cause) == (
        AttemptEnd.FAILED, "rank_failed", None)  # the root cause is picked from the evidence later
    assert exit_told(False, why) == {"hot_replace": why}
    assert exit_told(False, NOT_ALLOWED) == {} and exit_told(False, STOPPING) == {}


def test_a_rank_that_sent_its_failure_ends_the_attempt_whatever_the_refusal() -> None:
    h = _exited(Exit(1, None), failure=Failure(error="ValueError", message="bad", traceback="", phase="training"))
    for refusal in (STOPPING, NOT_ALLOWED, "the job's 3 hot replacement(s) are used"):
        outcome = exit_conclusion(h, False, refusal, 1)
        assert outcome is not None and (outcome.end, outcome.reason) == (AttemptEnd.FAILED, "rank_failed")
        assert outcome.root_cause is None


def test_exit_0_without_the_result_is_a_failure_whose_cause_says_so() -> None:
    h = _exited(Exit(0, None))
    outcome = exit_conclusion(h, False, NOT_ALLOWED, 3)
    assert outcome is not None and outcome.root_cause is not None
    cause = outcome.root_cause
    assert (cause.reason, cause.rank, cause.attempt, cause.exit_code, cause.phase) == (
        "rank_failed", 1, 3, 0, "TRAINING")
    assert cause.detail == "rank 1 exited 0 without sending its result"


@pytest.mark.anyio
async def test_the_timer_fires_at_the_deadline_it_was_last_set_to_and_not_before() -> None:
    clock = FakeClock(start=100.0, autojump=False)
    send, receive = open_events()
    timer = Timer(clock, send)
    fired: list[tuple[Event, float]] = []

    async def collect() -> None:
        async for event in receive:
            fired.append((event, clock.monotonic()))

    with send, receive:
        async with anyio.create_task_group() as tg:
            tg.start_soon(timer.run)
            tg.start_soon(collect)
            await anyio.wait_all_tasks_blocked()
            timer.set(110.0)
            await anyio.wait_all_tasks_blocked()
            clock.advance(5.0)
            await anyio.wait_all_tasks_blocked()
            assert fired == []
            timer.set(107.0)  # a frame moved the earliest deadline sooner
            await anyio.wait_all_tasks_blocked()
            clock.advance(2.0)
            await anyio.wait_all_tasks_blocked()
            assert fired == [(TimerFired(), 107.0)] and timer.at is None
            clock.advance(10.0)  # fired once: nothing more until it is set again
            await anyio.wait_all_tasks_blocked()
            assert len(fired) == 1
            timer.set(None)
            clock.advance(100.0)
            await anyio.wait_all_tasks_blocked()
            assert len(fired) == 1
            tg.cancel_scope.cancel()
