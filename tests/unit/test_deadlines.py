"""The attempt's deadlines as pure logic: each timeout fires when due, naming the right rank."""

from __future__ import annotations

from ddpd.daemon.attempt.deadlines import Limits, RankClock, Verdict, Watch, check
from ddpd.daemon.run.clock import FakeClock
from ddpd.daemon.run.outcome import AttemptEnd
from ddpd.protocol import RankState

LIMITS = Limits(join=30.0, heartbeat=10.0, progress=5.0, heartbeat_interval=1.0, wall=100.0, stop_warning=20.0)
S = RankState


def _watch(clock: FakeClock, **kw: object) -> Watch:
    base: dict[str, object] = {"number": 1, "started": clock.monotonic(), "nproc": 2, "script": False,
                               "wall_at": None}
    base.update(kw)
    return Watch(**base)  # type: ignore[arg-type]


def _at(clock: FakeClock, limits: Limits, watch: Watch, ranks: list[RankClock]) -> Verdict:
    return check(limits, watch, ranks, clock.monotonic())


def test_join_timeout_fires_at_the_join_deadline_and_names_the_rank_furthest_behind() -> None:
    clock = FakeClock()
    watch = _watch(clock)
    t0 = clock.monotonic()
    ranks = [RankClock(0, S.STORE_CONNECTED), RankClock(1, S.CONNECTED)]
    verdict = _at(clock, LIMITS, watch, ranks)
    assert verdict.outcome is None and verdict.next_at == t0 + 30.0
    clock.advance(29.999)
    assert _at(clock, LIMITS, watch, ranks).outcome is None
    clock.advance(0.001)
    outcome = _at(clock, LIMITS, watch, ranks).outcome
    assert outcome is not None and outcome.end is AttemptEnd.TIMED_OUT and outcome.reason == "join_timeout"
    assert outcome.hang and outcome.root_cause is not None
    assert outcome.root_cause.rank == 1 and outcome.root_cause.ranks == [1]
    assert "rank 0 waiting in init_process_group" in (outcome.root_cause.detail or "")


def test_join_timeout_counts_ranks_never_spawned() -> None:
    clock = FakeClock()
    watch = _watch(clock, nproc=3)
    ranks = [RankClock(0, S.JOINED, last_frame=clock.monotonic(), last_step_change=clock.monotonic())]
    clock.advance(30.0)
    ranks = [RankClock(0, S.JOINED, last_frame=clock.monotonic(), last_step_change=clock.monotonic())]
    outcome = _at(clock, LIMITS, watch, ranks).outcome
    assert outcome is not None and outcome.reason == "join_timeout"
    assert "2 rank(s) never spawned" in (outcome.root_cause.detail if outcome.root_cause else "")


def test_heartbeat_timeout_names_the_silent_rank_and_is_reported_missed_first() -> None:
    clock = FakeClock()
    watch = _watch(clock)
    t0 = clock.monotonic()
    quiet = RankClock(1, S.TRAINING, last_frame=t0, last_step_change=t0, step=3)

    def talking() -> RankClock:
        now = clock.monotonic()
        return RankClock(0, S.TRAINING, last_frame=now, last_step_change=now, step=int(now))

    clock.advance(2.0)  # MISSED_HEARTBEATS intervals of silence: reported once
    verdict = _at(clock, LIMITS, watch, [talking(), quiet])
    assert verdict.outcome is None and verdict.missed == (1,)
    reported = RankClock(1, S.TRAINING, last_frame=t0, last_step_change=t0, step=3, missed_reported=t0)
    assert _at(clock, LIMITS, watch, [talking(), reported]).missed == ()
    clock.advance(7.999)
    verdict = _at(clock, Limits(join=30, heartbeat=10, progress=60, heartbeat_interval=1), watch, [talking(), reported])
    assert verdict.outcome is None and verdict.next_at == t0 + 10.0
    clock.advance(0.001)
    outcome = _at(clock, Limits(join=30, heartbeat=10, progress=60, heartbeat_interval=1), watch,
                  [talking(), reported]).outcome
    assert outcome is not None and outcome.reason == "heartbeat_timeout" and outcome.hang
    assert outcome.root_cause is not None and outcome.root_cause.rank == 1


def test_progress_timeout_names_the_frozen_rank() -> None:
    clock = FakeClock()
    watch = _watch(clock)
    t0 = clock.monotonic()
    clock.advance(1.0)
    for _ in range(4):  # both beat every second; rank 0 steps, rank 1's counter stays at 7
        clock.advance(1.0)
        now = clock.monotonic()
        ranks = [RankClock(0, S.TRAINING, last_frame=now, last_step_change=now, step=int(now)),
                 RankClock(1, S.TRAINING, last_frame=now, last_step_change=t0 + 1.0, step=7)]
        assert _at(clock, LIMITS, watch, ranks).outcome is None
    clock.advance(1.0)
    now = clock.monotonic()
    ranks = [RankClock(0, S.TRAINING, last_frame=now, last_step_change=now, step=int(now)),
             RankClock(1, S.TRAINING, last_frame=now, last_step_change=t0 + 1.0, step=7)]
    outcome = _at(clock, LIMITS, watch, ranks).outcome
    assert outcome is not None and outcome.reason == "progress_timeout" and outcome.hang
    assert outcome.root_cause is not None and outcome.root_cause.ranks == [1] and outcome.root_cause.rank == 1
    assert "frozen at 7" in (outcome.root_cause.detail or "")


def test_a_joined_rank_setting_up_gets_at_least_the_join_timeout_before_its_first_step() -> None:
    clock = FakeClock()
    watch = _watch(clock, nproc=1)
    t0 = clock.monotonic()
    clock.advance(29.0)
    ranks = [RankClock(0, S.JOINED, last_frame=clock.monotonic(), last_step_change=t0)]
    assert _at(clock, LIMITS, watch, ranks).outcome is None
    clock.advance(1.0)
    ranks = [RankClock(0, S.JOINED, last_frame=clock.monotonic(), last_step_change=t0)]
    outcome = _at(clock, LIMITS, watch, ranks).outcome
    assert outcome is not None and outcome.reason == "progress_timeout"


def test_a_script_is_watched_for_progress_only_once_it_reports_steps() -> None:
    clock = FakeClock()
    watch = _watch(clock, nproc=1, script=True)
    t0 = clock.monotonic()
    clock.advance(60.0)
    ranks = [RankClock(0, S.JOINED, last_frame=clock.monotonic(), last_step_change=t0)]
    assert _at(clock, LIMITS, watch, ranks).outcome is None


def test_stop_warning_then_wall_time() -> None:
    clock = FakeClock()
    t0 = clock.monotonic()
    watch = _watch(clock, nproc=1, wall_at=t0 + 100.0)

    def ranks() -> list[RankClock]:
        now = clock.monotonic()
        return [RankClock(0, S.TRAINING, last_frame=now, last_step_change=now, step=int(now))]

    verdict = _at(clock, LIMITS, watch, ranks())
    assert not verdict.warn and verdict.next_at is not None and verdict.next_at <= t0 + 80.0
    clock.advance(79.9)
    assert not _at(clock, LIMITS, watch, ranks()).warn
    clock.advance(0.1)
    verdict = _at(clock, LIMITS, watch, ranks())
    assert verdict.warn and verdict.outcome is None
    warned = _watch(clock, nproc=1, wall_at=t0 + 100.0, warned=True, started=t0)
    assert not _at(clock, LIMITS, warned, ranks()).warn
    clock.advance(20.0)
    outcome = _at(clock, LIMITS, warned, ranks()).outcome
    assert outcome is not None and outcome.end is AttemptEnd.TIMED_OUT and outcome.reason == "wall_time"
    assert not outcome.hang


def test_stop_warning_is_at_most_half_the_wall_time() -> None:
    limits = Limits(join=30.0, heartbeat=10.0, progress=5.0, heartbeat_interval=1.0, wall=20.0, stop_warning=30.0)
    assert limits.stop_warning_lead == 10.0


def test_exited_ranks_have_no_deadlines() -> None:
    clock = FakeClock()
    watch = _watch(clock, nproc=1)
    ranks = [RankClock(0, S.EXITED, last_frame=clock.monotonic(), exited=True)]
    clock.advance(1000.0)
    verdict = _at(clock, LIMITS, watch, ranks)
    assert verdict.outcome is None and verdict.next_at is None


def test_a_rank_silent_after_its_script_returned_is_stuck_at_exit() -> None:
    """A rank that said its script returned (phase done) and then fell silent is named as stuck at
    exit, not as a rank silent in its work."""
    clock = FakeClock()
    watch = _watch(clock, script=True)
    t0 = clock.monotonic()
    done = RankClock(1, S.TRAINING, last_frame=t0, last_step_change=t0, step=200, finished=True)
    at_work = RankClock(0, S.TRAINING, last_frame=t0, last_step_change=t0, step=200)
    clock.advance(10.0)
    outcome = _at(clock, LIMITS, watch, [done]).outcome
    assert outcome is not None and outcome.reason == "heartbeat_timeout" and outcome.root_cause is not None
    assert outcome.root_cause.detail == "rank 1 finished its script, then sent nothing for 10.0s (stuck at exit)"
    outcome = _at(clock, LIMITS, watch, [at_work]).outcome
    assert outcome is not None and outcome.root_cause is not None
    assert outcome.root_cause.detail == "rank 0 sent nothing for 10.0s"


def test_a_finished_rank_waiting_for_its_peers_is_not_frozen() -> None:
    """Rank 0 sent its result and serves the store until its peer exits: its step stays put past
    the progress timeout while rank 1 still steps, and that is no hang."""
    clock = FakeClock()
    watch = _watch(clock)
    t0 = clock.monotonic()
    clock.advance(30.0)
    now = clock.monotonic()
    ranks = [RankClock(0, S.TRAINING, last_frame=now, last_step_change=t0, step=20, finished=True),
             RankClock(1, S.TRAINING, last_frame=now, last_step_change=now, step=19)]
    assert _at(clock, LIMITS, watch, ranks).outcome is None
    ranks[0] = RankClock(0, S.TRAINING, last_frame=now, last_step_change=t0, step=20)  # not finished: frozen
    outcome = _at(clock, LIMITS, watch, ranks).outcome
    assert outcome is not None and outcome.reason == "progress_timeout" and outcome.root_cause is not None
    assert outcome.root_cause.ranks == [0]


def test_a_rank_that_reported_its_failure_has_the_failed_exit_wait_to_exit_on_its_own() -> None:
    """Bug: a Failure frame ended the attempt at once, so the failing rank was SIGTERMed during its
    own exit work (its atexit handlers cut short, its root cause "died of signal SIGTERM"); under
    torchrun it exits on its own first."""
    clock = FakeClock()
    limits = Limits(join=30.0, heartbeat=100.0, progress=50.0, heartbeat_interval=1.0, failed_exit=5.0)
    watch = _watch(clock, nproc=1)
    t0 = clock.monotonic()
    failed = RankClock(0, S.JOINED, last_frame=t0, last_step_change=t0, failed_at=t0)
    clock.advance(4.9)
    verdict = _at(clock, limits, watch, [failed])
    assert verdict.outcome is None and verdict.next_at == t0 + 5.0
    clock.advance(0.1)
    outcome = _at(clock, limits, watch, [failed]).outcome
    assert outcome is not None and (outcome.end, outcome.reason) == (AttemptEnd.FAILED, "rank_failed")


def test_a_rank_silent_in_its_exit_work_after_its_result_is_ended_alone() -> None:
    """A rank that sent its result and then fell silent (its exit work holds the GIL) is to be ended
    by itself (`stuck`), its result kept: no outcome for the attempt, and not asked again."""
    clock = FakeClock()
    watch = _watch(clock, script=True, nproc=1)
    t0 = clock.monotonic()
    done = RankClock(0, S.TRAINING, last_frame=t0, last_step_change=t0, step=5, finished=True, has_result=True)
    clock.advance(10.0)
    verdict = _at(clock, LIMITS, watch, [done])
    assert verdict.outcome is None and verdict.stuck == (0,)
    ending = RankClock(0, S.TRAINING, last_frame=t0, last_step_change=t0, step=5, finished=True, has_result=True,
                       ending=True)
    verdict = _at(clock, LIMITS, watch, [ending])
    assert verdict.outcome is None and verdict.stuck == ()
