"""A rank's bounds and the success rule, as pure logic (no worker, no socket)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any, cast

from ddpd.daemon.attempt.decide import finished_outcome
from ddpd.daemon.attempt.launch import rank_env
from ddpd.daemon.attempt.ranks import FrameBudget, RankHandle, rank_succeeded
from ddpd.daemon.contain.procs import Exit
from ddpd.daemon.run.outcome import AttemptEnd
from ddpd.daemon.run.rendezvous import Rendezvous
from ddpd.daemon.store.records import Job, Rank
from ddpd.protocol import JobSpec, JobState
from ddpd.protocol.channel import Result
from ddpd.protocol.control import RootCause
from ddpd.protocol.limits import TEXT_LIMIT
from ddpd.protocol.worker import RESERVED_ENV, is_reserved_env, parse_worker_args, worker_args


def test_frame_budget_allows_the_rate_and_a_burst_then_refuses() -> None:
    budget = FrameBudget(rate=100.0, burst=100.0, now=0.0)
    assert all(budget.take(0.0) for _ in range(100))
    assert not budget.take(0.0)
    assert budget.take(0.5)  # half a second later: 50 frames more
    assert sum(budget.take(0.5) for _ in range(100)) == 49
    steady = FrameBudget(rate=100.0, burst=100.0, now=0.0)
    assert all(steady.take(i / 100) for i in range(1000))  # exactly the rate, for 10 s
    assert steady.count == 1000


def test_success_needs_the_result_in_task_mode_and_a_clean_exit_in_script_mode() -> None:
    result = Result(steps=20)
    assert rank_succeeded(Exit(0, None), result, script=False)
    assert not rank_succeeded(Exit(0, None), None, script=False)  # exit 0 is not evidence enough
    assert rank_succeeded(Exit(0, None), None, script=True)  # a script that never joins, as torchrun
    assert not rank_succeeded(Exit(1, None), result, script=False)
    assert not rank_succeeded(Exit(None, "SIGKILL"), result, script=True)
    assert not rank_succeeded(None, result, script=False)


def _handle(r: int, exit_: Exit | None, result: Result | None) -> RankHandle:
    h = RankHandle(rank=Rank(rank=r, attempt=1), proc=cast(subprocess.Popen[bytes], None),
                   channel=cast(Any, None))
    h.exit, h.result = exit_, result
    return h


def test_the_attempt_succeeds_once_every_rank_succeeded() -> None:
    ok = [_handle(0, Exit(0, None), Result(steps=5)), _handle(1, Exit(0, None), Result(steps=5))]
    kw: dict[str, Any] = {"cancel_requested": None, "warned": False, "stop_warning_lead": 0.0, "wall": None}
    outcome = finished_outcome(ok, 2, False, 1, **kw)
    assert outcome is not None and outcome.end is AttemptEnd.SUCCEEDED
    assert finished_outcome(ok[:1], 2, False, 1, **kw) is None  # a rank still running
    no_result = [ok[0], _handle(1, Exit(0, None), None)]
    assert finished_outcome(no_result, 2, False, 1, **kw) is None
    assert finished_outcome(no_result, 2, True, 1, **kw) is not None
    stopped = [_handle(0, Exit(0, None), Result(steps=3, stopped_early=True))]
    outcome = finished_outcome(stopped, 1, False, 1, **{**kw, "cancel_requested": "cancelled by user"})
    assert outcome is not None and outcome.end is AttemptEnd.CANCELLED
    outcome = finished_outcome(stopped, 1, False, 1, **{**kw, "warned": True, "wall": 60.0})
    assert outcome is not None and outcome.end is AttemptEnd.TIMED_OUT and outcome.reason == "wall_time"


def test_the_daemons_variables_win_over_the_jobs() -> None:
    """Bug: spec.env was applied after the daemon's own variables (marker and devices overridden)."""
    spec = JobSpec(nproc=2, env={"DDPD_ATTEMPT": "mine", "CUDA_VISIBLE_DEVICES": "0,1", "RANK": "7",
                                 "DDPD_OTHER": "x", "MY_VAR": "kept", "OMP_NUM_THREADS": "3"})
    job = Job(id="j1", seq=1, name="", owner_uid=0, spec=spec, state=JobState.STARTING, submitted_at=0.0)
    rdzv = Rendezvous(host="127.0.0.1", port=29500)
    env = rank_env({"PATH": "/bin"}, job, 1, 1, rdzv, "j1:1:tok", Path("/tmp/err.json"))
    assert env["DDPD_ATTEMPT"] == "j1:1:tok"
    assert env["CUDA_VISIBLE_DEVICES"] == ""  # a CPU job sees no GPU
    assert env["RANK"] == "1" and env["MASTER_PORT"] == "29500"
    assert "DDPD_OTHER" not in env
    assert env["MY_VAR"] == "kept" and env["OMP_NUM_THREADS"] == "3" and env["PATH"] == "/bin"
    set_by_daemon = {k for k in env if is_reserved_env(k)}
    assert set_by_daemon >= RESERVED_ENV


def test_the_worker_command_line_round_trips() -> None:
    args = parse_worker_args(worker_args(5, 1234, pool=True))
    assert (args.fd, args.parent, args.pool) == (5, 1234, True)
    assert not parse_worker_args(worker_args(5, 1234)).pool


def test_stored_root_causes_are_clipped_head_and_tail() -> None:
    """Bug: a 400 KB exception message made every status and ls reply exceed the frame limit."""
    huge = "KeyError: " + "k" * 400_000 + " at the end"
    cause = RootCause(reason="rank_failed", detail=huge, message=huge, traceback=huge).clipped()
    for text in (cause.detail, cause.message, cause.traceback):
        assert text is not None and len(text) <= TEXT_LIMIT
        assert text.startswith("KeyError: ") and text.endswith(" at the end")
