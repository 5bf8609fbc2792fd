"""The scheduler's decisions as pure functions on a fake clock: order (priority, fair share, submission),
what starts and why the rest wait, which jobs a higher-priority job preempts, and usage that decays."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from ddpd.daemon.config import Config
from ddpd.daemon.queue import decide
from ddpd.daemon.queue.decide import Preempt, Running, Wait
from ddpd.daemon.queue.fairshare import SHARE_USERS, FairShare, Usage, share_views
from ddpd.daemon.queue.live import LiveConfig
from ddpd.daemon.queue.resources import Resources
from ddpd.daemon.store.bus import EventBus
from ddpd.daemon.store.journal import Journal
from ddpd.daemon.store.records import Job
from ddpd.daemon.store.state import StateDB
from ddpd.protocol import JobSpec, JobState

ALICE, BOB = 1001, 1002
HOUR = 3600.0


def job(seq: int, owner: int = ALICE, *, nproc: int = 1, priority: int = 0, preemptible: bool = False,
        script: bool = False, state: JobState = JobState.QUEUED) -> Job:
    spec = JobSpec(task=None if script else "two-layer", script=["train.py"] if script else None, nproc=nproc,
                   priority=priority, preemptible=preemptible)
    return Job(id=f"j{seq}", seq=seq, name=f"j{seq}", owner_uid=owner, spec=spec, state=state, submitted_at=0.0)


def running(resources: Resources, *jobs_since: tuple[Job, float]) -> list[Running]:
    out = []
    for j, since in jobs_since:
        j.state = JobState.RUNNING
        gpus = resources.take(j.spec)
        assert gpus is not None
        j.gpus = gpus
        out.append(Running(j, since))
    return out


def cfg(**kw: object) -> Config:
    return Config(**kw)  # type: ignore[arg-type]


def kinds(decisions: list[decide.Decision]) -> list[tuple[str, str]]:
    return [(type(d).__name__, d.job.id) for d in decisions]


def test_priority_first_then_the_user_who_used_less_then_submission() -> None:
    a1, a2, b1, urgent = job(1), job(2), job(3, BOB), job(4, BOB, priority=5)
    fair = decide.factors({ALICE: 100.0, BOB: 0.0}, {ALICE, BOB})
    assert fair[BOB] == 1.0 and fair[ALICE] == pytest.approx(0.25)  # 2^(-(100/100)/(1/2))
    assert [j.id for j in decide.order([a1, a2, b1, urgent], fair)] == ["j4", "j3", "j1", "j2"]
    # no usage at all: submission order among equals
    assert [j.id for j in decide.order([b1, a2, a1], decide.factors({}, {ALICE, BOB}))] == ["j1", "j2", "j3"]


def test_the_head_is_never_overtaken_and_every_waiting_job_says_why() -> None:
    res = Resources(0, cpu_slots=2)
    busy = running(res, (job(1, BOB), 0.0))
    big, small = job(2, nproc=2), job(3)
    plan = decide.plan([big, small], set(), busy, {}, 10.0, res, cfg())
    assert kinds(plan) == [("Wait", "j2"), ("Wait", "j3")]  # j3 would fit, but j2 is first
    assert isinstance(plan[0], Wait) and plan[0].reason == "resources: needs 2 CPU slots, 1 of 2 free"
    assert isinstance(plan[1], Wait) and plan[1].reason == "priority: behind j2, which waits for resources"
    assert res.free_cpu == 1  # the plan took from a copy


def test_fair_share_lets_the_light_user_pass_and_says_so() -> None:
    res = Resources(0, cpu_slots=1)
    a2, a3, b1 = job(2), job(3), job(4, BOB)
    plan = decide.plan([a2, a3, b1], set(), [], {ALICE: 50.0}, 0.0, res, cfg())
    assert kinds(plan) == [("Start", "j4"), ("Wait", "j2"), ("Wait", "j3")]
    res2 = Resources(0, cpu_slots=1)
    busy = running(res2, (job(1, BOB), 0.0))
    plan = decide.plan([a2, job(5, BOB)], set(), busy, {ALICE: 10.0, BOB: 50.0}, 0.0, res2, cfg())
    assert kinds(plan) == [("Wait", "j2"), ("Wait", "j5")]
    assert isinstance(plan[1], Wait) and plan[1].reason.startswith("fair share: behind j2")


def test_limits_and_dependencies_hold_one_job_only() -> None:
    res = Resources(0, cpu_slots=4)
    dep, free = job(1), job(2)
    plan = decide.plan([dep, free], {"j1"}, [], {}, 0.0, res, cfg())
    assert kinds(plan) == [("Wait", "j1"), ("Start", "j2")]
    plan = decide.plan([job(3), job(4)], set(), [], {}, 0.0, res, cfg(max_running=1))
    assert kinds(plan) == [("Start", "j3"), ("Wait", "j4")]
    assert isinstance(plan[1], Wait) and plan[1].reason == "limit: 1 jobs running (max_running)"


def test_preempts_the_fewest_preemptible_jobs_of_lower_priority() -> None:
    res = Resources(0, cpu_slots=4)
    small = job(1, BOB, priority=-1, preemptible=True)
    big = job(2, BOB, nproc=2, priority=-1, preemptible=True)
    other = job(3, BOB, priority=-1, preemptible=True)
    busy = running(res, (small, 0.0), (big, 0.0), (other, 0.0))
    urgent = job(4, priority=10, nproc=2)
    plan = decide.plan([urgent], set(), busy, {}, 1000.0, res, cfg(preempt_min_run=60.0))
    assert len(plan) == 1 and isinstance(plan[0], Preempt)
    assert [v.id for v in plan[0].victims] == ["j2"]  # one job frees two slots: not j1 and j3
    assert res.free_cpu == 0  # nothing given back for real


def test_no_preemption_of_equal_priority_unmarked_young_or_stopping_jobs() -> None:
    res = Resources(0, cpu_slots=1)
    now = 1000.0
    for victim, since, config, stopping in [
        (job(1, BOB, priority=10, preemptible=True), 0.0, cfg(), frozenset[str]()),  # not lower
        (job(1, BOB, priority=-1), 0.0, cfg(), frozenset[str]()),  # not preemptible
        (job(1, BOB, priority=-1, preemptible=True), now - 10, cfg(preempt_min_run=60.0), frozenset[str]()),
    ]:
        r = Resources(0, cpu_slots=1)
        plan = decide.plan([job(2, priority=10)], set(), running(r, (victim, since)), {}, now, r, config,
                           stopping)
        assert kinds(plan) == [("Wait", "j2")], victim
    busy = running(res, (job(1, BOB, priority=-1, preemptible=True), 0.0))
    plan = decide.plan([job(2, priority=10)], set(), busy, {}, now, res, cfg(), {"j1"})
    assert isinstance(plan[0], Wait) and "checkpointing (j1)" in plan[0].reason  # one preemption at a time


def test_the_policy_band_takes_tasks_and_takes_scripts_only_where_allowed() -> None:
    band = cfg(preemptible_below=0)
    assert decide.preemptible(job(1, priority=-1).spec, band)
    assert not decide.preemptible(job(1, priority=0).spec, band)
    assert not decide.preemptible(job(1, priority=-1, script=True).spec, band)  # may not honour the stop API
    assert decide.preemptible(job(1, priority=-1, script=True).spec, cfg(preemptible_below=0, preempt_scripts=True))
    assert decide.preemptible(job(1, script=True, preemptible=True).spec, cfg())  # it said it honours it
    spread = dataclasses.replace(job(1, preemptible=True), spec=JobSpec(task="two-layer", preemptible=True,
                                                                      rdzv_endpoint="node0:29400"))
    assert not decide.preemptible(spread.spec, band)  # a multi-node job: its other nodes would fail


def test_usage_decays_by_half_each_half_life_and_charges_what_a_job_holds() -> None:
    u = Usage(gpu_seconds=80.0, cpu_seconds=40.0, at=0.0)
    assert u.decayed(HOUR, HOUR) == Usage(40.0, 20.0, HOUR)
    assert u.decayed(-5.0, HOUR) == Usage(80.0, 40.0, 0.0)  # a clock gone back: no decay, never forward
    assert Usage().plus(0.0, 2, 30.0, 30.0, HOUR).cpu_seconds == 60.0


def half_life(seconds: float) -> LiveConfig:
    """A live config with this fair-share half-life (the rest: defaults)."""
    return LiveConfig(Config(fairshare_half_life=seconds))


class _NoJournal:
    saved: dict[int, tuple[float, float, float]] = {}

    async def save_usage(self, rows: dict[int, tuple[float, float, float]]) -> None:
        self.saved.update(rows)


def test_fair_share_charges_running_jobs_on_a_fake_clock() -> None:
    share = FairShare(_NoJournal(), half_life(0.0))  # type: ignore[arg-type]
    a, b = job(1, nproc=2), job(2, BOB)
    share.start(a, 100.0)
    share.start(b, 110.0)
    assert share.charge([a, b], 120.0) == {ALICE, BOB}
    assert share.stop(b, 130.0) == {BOB}
    assert share.charge([a, b], 140.0) == {ALICE}  # b let go: no more charges
    now = share.now(140.0)
    assert now[ALICE].cpu_seconds == 80.0 and now[BOB].cpu_seconds == 20.0


@pytest.mark.anyio
async def test_usage_is_saved_and_loaded_through_the_journal(tmp_path: Path) -> None:
    db = StateDB(tmp_path / "ddpd.db")
    try:
        share = FairShare(Journal(db, EventBus()), half_life(HOUR))
        a = job(1, nproc=2)
        share.start(a, 0.0)
        await share.save(share.stop(a, 60.0))
        again = FairShare(Journal(db, EventBus()), half_life(HOUR))  # a daemon restart
        await again.load()
        assert again.usage == {ALICE: Usage(0.0, 120.0, 60.0)}
        assert again.now(60.0 + HOUR)[ALICE].cpu_seconds == pytest.approx(60.0)  # decays from where it was
    finally:
        db.close()


def test_running_charges_are_saved_now_and_then_not_at_every_decision() -> None:
    share = FairShare(_NoJournal(), half_life(0.0))  # type: ignore[arg-type]
    a = job(1)
    share.start(a, 0.0)
    share.charge([a], 1.0)
    assert share.due(1.0) == {ALICE}
    share.charge([a], 2.0)
    assert share.due(2.0) == set()  # saved a second ago
    assert share.due(40.0) == {ALICE}  # charged since, and the interval passed
    assert share.due(80.0) == set()  # nothing charged since


def test_the_share_table_lists_users_with_usage_or_jobs_next_served_first() -> None:
    a1, a2, b1 = job(1), job(2), job(3, BOB)
    usage = {ALICE: Usage(0.0, 300.0, 0.0), 7: Usage(0.0, 100.0, 0.0)}
    factors = decide.factors({uid: u.total for uid, u in usage.items()}, {ALICE, BOB, 7})
    views = share_views(usage, factors, [a1, a2, b1], running={"j1"})
    assert [(v.uid, v.running, v.queued, v.usage) for v in views] == [(BOB, 0, 1, 0.0), (7, 0, 0, 0.25),
                                                                       (ALICE, 1, 1, 0.75)]
    many = {uid: Usage(0.0, 1.0, 0.0) for uid in range(SHARE_USERS + 5)}
    assert len(share_views(many, {}, [], set())) == SHARE_USERS  # one frame, however many users ran


def test_preemption_frees_gpus_and_gives_up_at_once_when_all_candidates_would_not_do() -> None:
    res = Resources(2, cpu_slots=2)
    gpu = JobSpec(task="two-layer", nproc=1, gpus_per_rank=1, priority=-1, preemptible=True)
    first = dataclasses.replace(job(1, BOB), spec=gpu)
    second = dataclasses.replace(job(2, BOB), spec=gpu)
    busy = running(res, (first, 0.0), (second, 5.0))
    urgent = dataclasses.replace(job(3), spec=JobSpec(task="two-layer", nproc=1, gpus_per_rank=1, priority=1))
    plan = decide.plan([urgent], set(), busy, {}, 100.0, res, cfg(preempt_min_run=0.0))
    assert isinstance(plan[0], Preempt) and [v.id for v in plan[0].victims] == ["j2"]  # the most recent
    huge = dataclasses.replace(job(4), spec=JobSpec(task="two-layer", nproc=3, gpus_per_rank=1, priority=1))
    assert decide.victims(huge, busy, res, 100.0, cfg(preempt_min_run=0.0), frozenset()) is None
