"""Which warm-pool interpreters may serve which job (`PoolKey`), and how many of each the pool keeps
(`plan`): pure logic, a fake clock (plain numbers)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ddpd.daemon.pool.poolkeys import CLAIM_WAIT, Claims, Demand, PoolKey, Shape, next_expiry, plan, start_env

POOL = {"PATH": "/usr/bin", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "LANG": "C.UTF-8", "HOME": "/root"}


def key(uid: int = 1000, python: str = sys.executable, **env: str) -> PoolKey:
    return PoolKey.of(uid, python, {**POOL, **env})


def demand(k: PoolKey, ranks: int, last_used: float) -> Demand:
    return Demand(Shape(key=k, argv=(k.interpreter[1], "-m", "ddpd.worker"), env={}, identity=None, cwd="/"),
                  ranks, last_used)


def test_variables_applied_on_assignment_leave_the_key_alone() -> None:
    # PATH, a setting of the job's, the thread count and buffering: applied on assignment
    assert key(PATH="/opt/bin", MY_SETTING="hello", OMP_NUM_THREADS="4", PYTHONUNBUFFERED="0") == key()


def test_a_variable_read_at_start_that_differs_is_another_key() -> None:
    assert key(PYTHONPATH="/mine") != key()
    assert key(LANG="de_DE.UTF-8") != key()
    assert key(HOME="/home/other") != key()  # the user's site-packages directory
    assert PoolKey.of(1000, sys.executable, {}) != key()  # LANG missing: torch would start differently


def test_another_user_is_another_key() -> None:
    assert key(uid=1001) != key(uid=1000)


def test_another_interpreter_or_venv_is_another_key(tmp_path: Path) -> None:
    venv_bin = tmp_path / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "python").symlink_to(os.path.realpath(sys.executable))  # a venv over the same base interpreter
    assert key(python=str(venv_bin / "python")) != key()


def test_the_key_label_names_no_environment_value() -> None:
    assert "C.UTF-8" not in key().label() and "uid 1000" in key().label()


def test_a_pooled_interpreter_starts_with_the_start_up_variables_and_the_identity_only() -> None:
    base = {**POOL, "USER": "ann", "SECRET_TOKEN": "x", "CUDA_VISIBLE_DEVICES": "3", "OMP_NUM_THREADS": "8"}
    assert start_env(base) == {"PATH": "/usr/bin", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
                               "LANG": "C.UTF-8", "HOME": "/root", "USER": "ann"}


def test_a_key_wants_two_jobs_worth_of_its_last_job_up_to_the_per_key_bound() -> None:
    a = key()
    p = plan({a: demand(a, 2, 0.0)}, {}, total=8, per_key=4, idle_expiry=600, now=1.0)
    assert p.spawn == {a: 4} and not p.retire and not p.forget  # the next job and the one after it
    p = plan({a: demand(a, 8, 0.0)}, {a: 1}, total=8, per_key=4, idle_expiry=600, now=1.0)
    assert p.spawn == {a: 3}
    p = plan({a: demand(a, 1, 0.0)}, {a: 2}, total=8, per_key=4, idle_expiry=600, now=1.0)
    assert p.spawn == {} and p.retire == {}
    p = plan({a: demand(a, 1, 0.0)}, {a: 4}, total=8, per_key=4, idle_expiry=600, now=1.0)
    assert p.retire == {a: 2}  # its jobs got smaller


def test_the_key_used_last_takes_the_room_of_the_key_used_longest_ago() -> None:
    old, mid, new = key(PYTHONPATH="/old"), key(PYTHONPATH="/mid"), key(PYTHONPATH="/new")  # one user's
    d = {old: demand(old, 2, 10.0), mid: demand(mid, 2, 20.0), new: demand(new, 2, 30.0)}
    p = plan(d, {old: 2, mid: 2}, total=4, per_key=2, idle_expiry=600, now=31.0)
    assert p.spawn == {new: 2} and p.retire == {old: 2} and not p.forget


def test_the_total_bound_holds_whatever_the_demand() -> None:
    keys = [key(PYTHONPATH=f"/p{u}") for u in range(10)]
    d = {k: demand(k, 4, float(i)) for i, k in enumerate(keys)}
    p = plan(d, {}, total=5, per_key=2, idle_expiry=600, now=100.0)
    assert sum(p.spawn.values()) == 5
    assert p.spawn == {keys[9]: 2, keys[8]: 2, keys[7]: 1}
    many = {k: demand(k, 4, float(i)) for i, k in enumerate(key(uid=u) for u in range(10))}
    assert sum(plan(many, {}, total=5, per_key=2, idle_expiry=600, now=100.0).spawn.values()) == 5
    assert sum(plan(d, {}, total=0, per_key=2, idle_expiry=600, now=100.0).spawn.values()) == 0


def test_an_idle_key_expires_and_its_interpreters_are_retired() -> None:
    a, b = key(uid=1), key(uid=2)
    d = {a: demand(a, 2, 0.0), b: demand(b, 2, 500.0)}
    assert next_expiry(d, 600) == 600.0
    assert plan(d, {a: 2, b: 2}, total=4, per_key=2, idle_expiry=600, now=599.0).forget == ()
    p = plan(d, {a: 2, b: 2}, total=4, per_key=2, idle_expiry=600, now=600.0)
    assert p.forget == (a,) and p.retire == {a: 2} and p.spawn == {}
    assert next_expiry({}, 600) is None


def test_interpreters_of_a_forgotten_key_are_retired() -> None:
    a = key()
    assert plan({}, {a: 1}, total=4, per_key=2, idle_expiry=600, now=0.0).retire == {a: 1}


def test_each_active_user_keeps_one_warm_interpreter_and_at_most_an_even_share() -> None:
    """Bug: one user cycling environment keys evicted another user's warm interpreters."""
    theirs = key(uid=2)
    cycling = [key(uid=1, PYTHONPATH=f"/k{i}") for i in range(6)]
    d = {theirs: demand(theirs, 2, 0.0), **{k: demand(k, 2, 10.0 + i) for i, k in enumerate(cycling)}}
    p = plan(d, {theirs: 2}, total=4, per_key=4, idle_expiry=600, now=20.0)
    assert p.retire == {}  # the other user's two are its even share (4 // 2 users)
    assert sum(p.spawn.values()) == 2 and set(p.spawn) <= set(cycling)
    third = key(uid=3)
    d[third] = demand(third, 2, 30.0)
    p = plan(d, {theirs: 2, cycling[-1]: 2}, total=4, per_key=4, idle_expiry=600, now=31.0)
    assert p.spawn == {third: 1}  # a third user gets one at once: shares of 4 // 3 users, one each at least
    assert p.retire == {theirs: 1, cycling[-1]: 1}


def test_a_claim_holds_a_jobs_ranks_until_its_takes_or_its_wait_lapses() -> None:
    """A starting job's ranks are no surplus to retire until it took them; a claim no take follows
    lapses after CLAIM_WAIT (a launch that failed never holds one for good)."""
    claims, a, b = Claims(), key(), key(uid=1001)
    claims.claim(a, 2, now=100.0)
    assert (claims.held(a, 100.0), claims.held(b, 100.0)) == (2, 0)
    claims.took(a)
    assert claims.held(a, 101.0) == 1
    claims.took(a)
    claims.took(a)  # a cold rank's take finds none ready: never below none
    assert claims.held(a, 101.0) == 0
    claims.claim(a, 1, now=200.0)
    assert claims.held(a, 200.0 + CLAIM_WAIT - 0.1) == 1 and claims.held(a, 200.0 + CLAIM_WAIT) == 0
    claims.claim(b, 3, now=300.0)
    claims.forget(b)
    assert claims.held(b, 300.0) == 0
