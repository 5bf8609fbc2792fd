"""Training curves: the bounded downsampler (pure), the per-job feed from the ranks' reports, and the
store that keeps them in the journal (a real SQLite file)."""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from ddpd.daemon.store.bus import EventBus
from ddpd.daemon.store.curves import CurveStore, curve_result
from ddpd.daemon.store.downsample import MAX_POINTS, Curve, CurveState, JobFeed
from ddpd.daemon.store.journal import Journal
from ddpd.daemon.store.records import Job
from ddpd.daemon.store.state import StateDB
from ddpd.protocol import JobSpec, JobState
from ddpd.protocol.control import EventView


def test_a_long_feed_stays_bounded_and_keeps_its_shape() -> None:
    curve = Curve()
    n = 50_000
    for i in range(1, n + 1):  # 10 steps a second, loss decaying from 1 to e^-5
        assert curve.add(t=i / 10, step=i, loss=math.exp(-5 * i / n))
    buckets = curve.buckets
    assert MAX_POINTS // 2 <= len(buckets) <= MAX_POINTS
    steps = [b.step for b in buckets]
    assert steps == sorted(set(steps)) and steps[-1] == n
    assert steps[0] <= n // MAX_POINTS * 2  # the start of the run is still there
    gaps = [b - a for a, b in itertools.pairwise(steps)]
    assert max(gaps) <= 2 * min(gaps)  # even density over the whole run
    for b in buckets:
        assert b.loss is not None and abs(b.loss - math.exp(-5 * b.step / n)) < 0.02
        assert b.rate() is None or b.rate() == pytest.approx(10.0)
    assert sum(b.n for b in buckets) == n


def test_nonfinite_losses_are_kept_out_but_their_steps_count() -> None:
    curve = Curve()
    for i, loss in enumerate([1.0, math.nan, math.inf, -math.inf, 1e308 * 10, 3.0, None, 5.0], start=1):
        assert curve.add(t=float(i), step=i, loss=loss)
    assert curve.state.nonfinite == 4
    assert [b.loss for b in curve.buckets] == [1.0, None, None, None, None, 3.0, None, 5.0]
    merged = Curve(CurveState(buckets=list(curve.buckets)), max_points=2)  # steps 1-4 and 5-8
    assert [(b.step, b.loss) for b in merged.buckets] == [(4, 1.0), (8, 4.0)]  # means of the finite ones
    text = msgspec.json.encode(curve.state)  # never a NaN in what is stored or sent
    assert b"NaN" not in text and b"Infinity" not in text


def test_hostile_steps_and_times_are_refused() -> None:
    curve = Curve()
    assert curve.add(t=1.0, step=10, loss=1.0)
    assert not curve.add(t=2.0, step=5, loss=1.0)  # backwards
    assert not curve.add(t=math.nan, step=20, loss=1.0)
    assert not curve.add(t=3.0, step=-1, loss=1.0)
    assert not curve.add(t=3.0, step=2**64, loss=1.0)
    assert not curve.add(t=3.0, step=10, loss=1.0)  # the same step again
    assert curve.state.backwards == 1
    assert [b.step for b in curve.buckets] == [10]


def test_a_restarted_attempt_rejoins_the_curve_past_its_last_step() -> None:
    curve = Curve()
    for step in (10, 20, 30):
        curve.add(t=float(step), step=step, loss=1.0, attempt=1)
    assert not curve.add(t=100.0, step=21, loss=0.5, attempt=2)  # resumed from a checkpoint at 20
    assert not curve.add(t=101.0, step=30, loss=0.5, attempt=2)
    assert curve.add(t=102.0, step=32, loss=0.5, attempt=2)
    last = curve.buckets[-1]
    assert last.step == 32 and last.rate() == pytest.approx(2.0)  # from its own attempt's last sample


def test_steps_per_second_survive_merging() -> None:
    curve = Curve(max_points=8)
    t = 0.0
    for step in range(1, 101):
        t += 0.5 if step <= 50 else 0.25  # 2 steps/s, then 4
        curve.add(t=t, step=step, loss=None)
    rates = [b.rate() for b in curve.buckets if b.rate() is not None]
    assert rates[0] == pytest.approx(2.0) and rates[-1] == pytest.approx(4.0)


def test_feed_averages_the_ranks_losses_at_the_same_step_only() -> None:
    """Bug: a point averaged one rank's stale loss with another's current one (2.36 between 4.68 and
    0.0037), and the first point was rank 0's loss alone."""
    feed = JobFeed()
    assert not feed.report(1.0, 1, 0, step=1, loss=1.0)  # waits for the others
    assert not feed.report(1.1, 1, 1, step=1, loss=3.0)
    assert feed.report(2.0, 1, 0, step=3, loss=2.0)  # the leader moved on: step 1 is the mean of both
    assert not feed.report(2.1, 1, 1, step=4, loss=9.0)  # rank 1 passed step 3 without a loss there
    assert feed.report(3.0, 1, 0, step=5, loss=1.0)  # step 3: rank 0's alone, never rank 1's older loss
    assert not feed.report(3.2, 1, 1, step=5, loss=math.nan)  # kept out of step 5's mean
    assert not feed.report(3.3, 1, 1, step=7, loss=0.7)  # ahead of the leader: kept for step 7
    assert feed.report(4.0, 1, 0, step=7, loss=0.5)
    assert feed.report(4.1, 1, 0, step=8, loss=0.4, final=True)
    assert [(b.step, b.loss) for b in feed.curve.buckets] == [(1, 2.0), (3, 2.0), (5, 1.0), (7, pytest.approx(0.6))]
    assert feed.curve.state.nonfinite == 1
    assert feed.report(4.2, 1, 1, step=8, loss=0.6, final=True)  # every rank's result: the last point
    assert feed.curve.buckets[-1].step == 8 and feed.curve.buckets[-1].loss == pytest.approx(0.5)
    assert not feed.report(5.0, 2, 1, step=9, loss=5.0)  # a new attempt where rank 1 reports first: it leads
    assert feed.finish() and feed.curve.buckets[-1].loss == 5.0  # the job ended: what is pending goes in


def test_steps_per_second_need_a_second_or_ten_steps() -> None:
    """Bug: two reports microseconds apart made 233,017 steps/s."""
    curve = Curve()
    curve.add(t=100.0, step=1, loss=None)
    curve.add(t=100.2, step=5, loss=None)
    curve.add(t=100.5, step=12, loss=None)  # 11 steps since step 1
    curve.add(t=100.500001, step=13, loss=None)
    rates = [b.rate() for b in curve.buckets]
    assert rates[:2] == [None, None] and rates[2] == pytest.approx(11 / 0.5)
    assert rates[3] == pytest.approx(12 / 0.500001)  # from step 1, the latest sample 10 steps back


def test_extend_appends_a_later_curve() -> None:
    a, b = Curve(max_points=4), Curve(max_points=4)
    for step in range(1, 4):
        a.add(t=float(step), step=step, loss=1.0)
    for step in range(2, 10):
        b.add(t=float(step + 10), step=step, loss=2.0, attempt=2)
    a.extend(b)
    steps = [x.step for x in a.buckets]
    assert steps == sorted(steps) and steps[-1] == 9 and len(steps) <= 4


# -- the store, against a real journal -----------------------------------------------------------


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[Journal]:
    db = StateDB(tmp_path / "ddpd.db")
    yield Journal(db, EventBus())
    db.close()


def _progress(job_id: str, rank: int, step: int, loss: float, attempt: int = 1,
              kind: str = "rank.progress") -> EventView:
    return EventView(seq=0, ts=time.time() + step, kind=kind, job_id=job_id, attempt=attempt, rank=rank,
                     data={"step": step, "loss": loss})


@pytest.mark.anyio
async def test_store_writes_curves_forgets_ended_ones_and_reads_them_back(journal: Journal) -> None:
    job = Job(id="j1-abcd", seq=1, name="t", owner_uid=1000, spec=JobSpec(task="two-layer", steps=40),
              state=JobState.SUCCEEDED, submitted_at=time.time())
    await journal.create_job(job)
    store = CurveStore(journal)
    journal.bus.listen(store.observe)
    for step in range(1, 41):
        journal.bus.publish(_progress(job.id, 0, step, 1.0 / step))
    journal.bus.publish(_progress("j9-none", 0, 1, 1.0))  # a job with no row: never written
    journal.bus.publish(EventView(seq=0, ts=time.time(), kind="job.finished", job_id=job.id))
    await store.flush()
    assert job.id not in store.entries
    result = curve_result(job, await store.curve(job.id))
    assert [p.step for p in result.points] == list(range(1, 41)) and result.steps == 40
    assert result.points[-1].loss == pytest.approx(1 / 40)
    assert await journal.load_curve("j9-none") is None
    # a new daemon that records more of the same job appends to what the earlier one stored
    later = CurveStore(journal)
    later.observe(_progress(job.id, 0, 45, 0.01, attempt=2, kind="rank.result"))
    curve = await later.curve(job.id)
    assert curve is not None and [b.step for b in curve.buckets][-2:] == [40, 45]
    await journal.delete_job(job.id)
    assert await journal.load_curve(job.id) is None


@pytest.mark.parametrize("order", list(itertools.permutations(["p0", "p1", "r0", "r1"])))
def test_the_last_point_is_the_mean_at_the_last_step_whatever_order_reports_and_results_come_in(
        order: tuple[str, ...]) -> None:
    """Bug: the leader's result at a step it had reported as progress replaced the pending point, and
    with it the other rank's loss at that step: the last point was rank 0's loss alone."""
    reports = {"p0": (0, 48, 1.0, False), "p1": (1, 48, 3.0, False), "r0": (0, 48, 1.0, True),
               "r1": (1, 48, 3.0, True)}
    feed = JobFeed()
    feed.report(1.0, 1, 0, 41, 5.0)
    feed.report(1.0, 1, 1, 41, 7.0)
    for t, name in enumerate(order, start=2):
        rank, step, loss, final = reports[name]
        feed.report(float(t), 1, rank, step, loss, final=final)
    feed.finish()
    assert [(b.step, b.loss) for b in feed.curve.buckets] == [(41, 6.0), (48, 2.0)]
