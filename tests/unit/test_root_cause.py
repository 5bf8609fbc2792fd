"""Who failed first, as pure logic: a rank's own exit or error before the collateral failures of
its peers, with the exit code of the rank that failed first."""

from __future__ import annotations

from ddpd.daemon.contain.procs import Exit
from ddpd.daemon.run.rootcause import Evidence, pick_root_cause
from ddpd.protocol.channel import Failure

COLLATERAL = Failure(error="DistBackendError", message="Connection closed by peer", traceback="tb", phase="joined")


def test_a_script_exit_3_is_the_root_cause_with_its_exit_code_and_no_traceback() -> None:
    evidence = [
        Evidence(rank=0, state="JOINED", exit=Exit(1, None), failure=COLLATERAL, failed_at=1.0,
                 signals_sent_before_exit=frozenset()),
        Evidence(rank=1, state="JOINED", exit=Exit(3, None), failure=None, failed_at=2.0,
                 signals_sent_before_exit=frozenset()),
    ]
    cause = pick_root_cause(evidence, attempt=1)
    assert cause is not None
    assert (cause.rank, cause.exit_code, cause.signal) == (1, 3, None)
    assert cause.traceback is None and cause.error is None
    assert cause.detail == "rank 1 died of exit code 3"


def test_a_rank_terminated_by_the_teardown_is_not_the_root_cause() -> None:
    evidence = [
        Evidence(rank=0, state="JOINED", exit=Exit(None, "SIGTERM"), failure=None, failed_at=1.0,
                 signals_sent_before_exit=frozenset({"SIGTERM"})),
        Evidence(rank=1, state="TRAINING", exit=Exit(1, None),
                 failure=Failure(error="ValueError", message="bad batch", traceback="tb", phase="training"),
                 failed_at=2.0, signals_sent_before_exit=frozenset()),
    ]
    cause = pick_root_cause(evidence, attempt=2)
    assert cause is not None and (cause.rank, cause.exit_code, cause.error, cause.attempt) == (1, 1, "ValueError", 2)
