"""A rank's repeated events are persisted within a budget: coalesced re-joins, a token bucket, a cap."""

from __future__ import annotations

from ddpd.daemon.store.eventbudget import BURST, CAP, RATE, REJOINS_KEPT, EventBudget, rejoin_kept


def test_rejoins_are_coalesced_to_powers_of_two() -> None:
    kept = [n for n in range(1, 10_001) if rejoin_kept(n)]
    assert kept[:REJOINS_KEPT] == list(range(1, REJOINS_KEPT + 1))
    assert kept[REJOINS_KEPT:] == [16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]


def test_a_burst_then_the_rate_then_nothing() -> None:
    budget = EventBudget()
    assert all(budget.admit(0.0) for _ in range(int(BURST)))
    assert not budget.admit(0.0) and budget.first_refusal
    assert not budget.admit(0.0) and not budget.first_refusal  # noted once
    assert budget.admit(1.0 / RATE)  # one more token a 1/RATE seconds later
    assert not budget.admit(1.0 / RATE)


def test_the_cap_holds_however_slow_the_rank() -> None:
    budget = EventBudget()
    kept = sum(budget.admit(i * 10.0 / RATE) for i in range(CAP + 100))
    assert kept == CAP
