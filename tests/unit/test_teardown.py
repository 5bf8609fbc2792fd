"""Teardown escalation as pure logic: stop, TERM+CONT, KILL share one deadline (fake clock, no processes)."""

from __future__ import annotations

import signal

import anyio
import pytest

from ddpd.daemon.attempt.teardown import TERM_SHARE, UNKILLABLE_WAIT, Escalation, escalate
from ddpd.daemon.run.clock import FakeClock, wait_until

pytestmark = pytest.mark.anyio


class FakeGang:
    """Ranks that exit `delay` seconds after the first of the actions in `exits_on` (never: unkillable)."""

    def __init__(self, clock: FakeClock, exits_on: dict[str, float]) -> None:
        self.clock = clock
        self.exits_on = exits_on
        self.exit_at: float | None = None
        self.calls: list[tuple[str, float]] = []

    def _did(self, action: str) -> None:
        self.calls.append((action, self.clock.monotonic()))
        if action in self.exits_on and self.exit_at is None:
            self.exit_at = self.clock.monotonic() + self.exits_on[action]

    def alive(self) -> bool:
        return self.exit_at is None or self.clock.monotonic() < self.exit_at

    async def request_stop(self, grace: float) -> None:
        self._did("stop")

    async def dump_stacks(self) -> None:
        self._did("dump")
        await self.clock.sleep_until(self.clock.monotonic() + 1.0)  # the dump takes a second

    async def signal(self, signum: signal.Signals, grace: float) -> None:
        self._did(signum.name)

    async def wait_exited(self, deadline: float) -> bool:
        if self.exit_at is not None and self.exit_at <= deadline:
            await self.clock.sleep_until(self.exit_at)
            return True
        await self.clock.sleep_until(deadline)
        return False

    async def report_unkillable(self) -> None:
        self._did("unkillable")

    async def sweep(self) -> None:
        self._did("sweep")


async def _run(exits_on: dict[str, float], grace: float = 2.0, graceful: bool = False,
               hang: bool = False) -> tuple[FakeGang, Escalation, float]:
    clock = FakeClock()
    gang = FakeGang(clock, exits_on)
    t0 = clock.monotonic()
    with anyio.fail_after(1):  # fake time: milliseconds of real time
        done = await escalate(gang, clock, grace, graceful=graceful, hang=hang)
    return gang, done, clock.monotonic() - t0


async def test_ranks_that_stop_gracefully_get_no_signal() -> None:
    _gang, done, took = await _run({"stop": 0.5}, graceful=True)
    assert done.names == ["stop", "sweep"]
    assert took == pytest.approx(0.5)


async def test_ignoring_stop_and_term_takes_one_grace_not_two() -> None:
    """Bug: a cancel of ranks that ignore SIGTERM took 4.05 s with a 2 s grace (stop, then TERM, each a grace)."""
    gang, done, took = await _run({"SIGKILL": 0.01}, grace=2.0, graceful=True)
    assert done.names == ["stop", "TERM", "KILL", "sweep"]
    at = dict(done.steps)
    assert at["TERM"] - at["stop"] == pytest.approx(2.0 - min(1.0, TERM_SHARE))
    assert at["KILL"] - at["stop"] == pytest.approx(2.0)  # the one deadline
    assert took == pytest.approx(2.01)
    assert [c for c, _ in gang.calls] == ["stop", "SIGTERM", "SIGCONT", "SIGKILL", "sweep"]


async def test_term_is_enough_for_ranks_that_honour_it() -> None:
    _gang, done, took = await _run({"SIGTERM": 0.2}, grace=5.0)
    assert done.names == ["TERM", "sweep"]
    assert took == pytest.approx(0.2)


async def test_without_a_graceful_stop_term_gets_the_whole_grace() -> None:
    _gang, done, _took = await _run({"SIGKILL": 0.0}, grace=5.0)
    at = dict(done.steps)
    assert at["KILL"] - at["TERM"] == pytest.approx(5.0)


async def test_a_hang_dumps_stacks_first_and_the_deadline_starts_after_the_dump() -> None:
    _gang, done, _took = await _run({"SIGKILL": 0.0}, grace=2.0, hang=True)
    assert done.names == ["dump", "TERM", "KILL", "sweep"]
    at = dict(done.steps)
    assert at["TERM"] - at["dump"] == pytest.approx(1.0)
    assert done.deadline is not None and at["KILL"] == pytest.approx(done.deadline)


async def test_unkillable_ranks_are_reported_after_a_bounded_wait() -> None:
    _gang, done, took = await _run({}, grace=2.0, graceful=True)
    assert done.names == ["stop", "TERM", "KILL", "unkillable", "sweep"]
    assert took == pytest.approx(2.0 + UNKILLABLE_WAIT)


async def test_dead_ranks_need_only_the_sweep() -> None:
    clock = FakeClock()
    gang = FakeGang(clock, {})
    gang.exit_at = clock.monotonic()
    done = await escalate(gang, clock, 2.0, graceful=True, hang=True)
    assert done.names == ["sweep"]


async def test_wait_until_returns_what_finished_first() -> None:
    clock = FakeClock(autojump=False)
    event = anyio.Event()
    with anyio.fail_after(1):
        async with anyio.create_task_group() as tg:
            result: list[bool] = []

            async def waiter() -> None:
                result.append(await wait_until(clock, clock.monotonic() + 10.0, event.wait))

            tg.start_soon(waiter)
            await anyio.wait_all_tasks_blocked()
            event.set()
        assert result == [True]
        event = anyio.Event()
        async with anyio.create_task_group() as tg:
            result.clear()
            tg.start_soon(waiter)
            await anyio.wait_all_tasks_blocked()
            clock.advance(10.0)
        assert result == [False]
