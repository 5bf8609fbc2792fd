"""The built-in loop's pure logic: coalesced progress (which steps are reported, when the loss is read)
and the process group's collective timeout."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ddpd.protocol import JobSpec
from ddpd.protocol.channel import Assign, Progress, WorkerMessage
from ddpd.worker.loop import PROGRESS_MAX, PROGRESS_MIN, ProgressReporter, collective_timeout, progress_interval
from ddpd.worker.runtime import Runtime


class Sent:
    """Stands in for the channel: what the reporter sends."""

    def __init__(self) -> None:
        self.messages: list[WorkerMessage] = []

    def send(self, message: WorkerMessage) -> None:
        self.messages.append(message)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def reporter(interval: float = 0.5) -> tuple[ProgressReporter, Runtime, Sent, Clock, list[int]]:
    sent, clock, reads = Sent(), Clock(), []
    runtime = Runtime(sent)  # type: ignore[arg-type]

    def read(losses: Sequence[Any]) -> float:
        reads.append(len(losses))
        return float(sum(losses)) / len(losses)

    return ProgressReporter(runtime, interval, clock=clock, read=read), runtime, sent, clock, reads


def steps(sent: Sent) -> list[int]:
    return [m.step for m in sent.messages if isinstance(m, Progress)]


def test_first_step_then_one_per_interval_and_the_final_step() -> None:
    rep, runtime, sent, clock, reads = reporter(0.5)
    for step in range(1, 101):  # 100 steps of 10 ms
        rep.stepped(step, [float(step)], final=step == 100)
        assert runtime.step == step  # the heartbeat thread always sees the step
        clock.now += 0.01
    assert steps(sent) == [1, 51, 100]
    assert len(reads) == 3  # the loss is read only for a frame that goes out
    assert runtime.loss == 100.0
    rep.flush()  # the final step is out already: nothing more
    assert steps(sent) == [1, 51, 100]


def test_flush_reports_the_last_step_of_a_stopped_run_with_its_mean_loss() -> None:
    rep, runtime, sent, _, _ = reporter(1.0)
    rep.stepped(8, [1.0, 3.0])  # a resumed attempt: its first step is reported
    rep.stepped(9, [2.0, 4.0])
    assert steps(sent) == [8]
    rep.flush()
    assert steps(sent) == [8, 9]
    assert runtime.loss == 3.0
    assert [m.loss for m in sent.messages if isinstance(m, Progress)] == [2.0, 3.0]


def test_flush_before_any_step_sends_nothing() -> None:
    rep, runtime, sent, _, reads = reporter()
    rep.flush()
    assert sent.messages == [] and reads == [] and runtime.loss is None


def test_interval_follows_the_heartbeat_within_bounds() -> None:
    assert progress_interval(0.01) == PROGRESS_MIN
    assert progress_interval(0.5) == 0.5
    assert progress_interval(30.0) == PROGRESS_MAX
    assert 1 / PROGRESS_MIN <= 4  # a few frames per second per rank at most


def test_collective_timeout_comes_from_the_daemon_else_the_join_timeout() -> None:
    assign = Assign(job_id="j", attempt=1, rank=0, world_size=1, local_rank=0, local_world_size=1,
                    store_host="127.0.0.1", store_port=1, spec=JobSpec(), env={}, heartbeat_interval=1.0,
                    join_timeout=45.0, checkpoint_dir="")
    assert collective_timeout(assign, {"DDPD_COLLECTIVE_TIMEOUT": "675"}) == 675.0
    assert collective_timeout(assign, {}) == 45.0
    for bad in ("", "soon", "nan", "inf", "-5", "0"):
        assert collective_timeout(assign, {"DDPD_COLLECTIVE_TIMEOUT": bad}) == 45.0, bad
