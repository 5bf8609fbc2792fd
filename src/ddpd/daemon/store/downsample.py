"""A job's training curve, bounded: step, loss and steps per second, downsampled by merging neighbours.

Pure logic, no I/O and no clock: times come with the samples.

`Curve` holds at most `MAX_POINTS` buckets. Each sample either joins the last bucket (while that one
holds fewer than `stride` samples) or opens a new one; when the buckets overflow, neighbours are
merged in pairs and the stride doubles, so the curve keeps its shape over the whole run at an even
density (every bucket covers about as many samples), whatever the run's length.

A bucket keeps its last sample's time and step, the mean of its finite losses (weighted by how many
each side merged) and the steps done over the seconds it spans (its steps per second). Hostile
samples are kept out: a time or step that is not a finite number in range, a step that goes
backwards (counted in `backwards`; a restarted attempt that resumes from an earlier checkpoint joins
the curve again once it passes the last step recorded), a loss that is NaN or infinite (the step
is kept, the loss counted in `nonfinite`).

`JobFeed` turns the progress reports of a job's ranks into samples: a sample per report of the
lowest rank that reports (normally rank 0), its loss the mean of every rank's last finite loss.
"""

from __future__ import annotations

import math

import msgspec

MAX_POINTS = 512
MAX_STEP = 2**63 - 1
MAX_LOSS = 1e300  # a loss beyond this is treated as not finite (means of such values would overflow)


class Bucket(msgspec.Struct, array_like=True):
    """Samples merged into one point: `t`/`step` are the last sample's; `loss` the mean of the `losses`
    finite losses; `done` steps over `span` seconds (both 0 for a sample with no predecessor)."""

    t: float
    step: int
    loss: float | None
    done: int
    span: float
    n: int = 1
    losses: int = 0

    def rate(self) -> float | None:
        return self.done / self.span if self.span > 0 else None


def merge(a: Bucket, b: Bucket) -> Bucket:
    """Two neighbouring buckets (`a` before `b`) as one."""
    losses = a.losses + b.losses
    if a.loss is None or b.loss is None:
        loss = a.loss if b.loss is None else b.loss
    else:  # weights that sum to 1: no overflow for any two finite losses
        loss = a.loss * (a.losses / losses) + b.loss * (b.losses / losses)
    return Bucket(t=b.t, step=b.step, loss=loss, done=a.done + b.done, span=a.span + b.span, n=a.n + b.n,
                  losses=losses)


class CurveState(msgspec.Struct):
    """A curve as stored (the journal keeps one per job, as JSON)."""

    buckets: list[Bucket] = msgspec.field(default_factory=list)
    stride: int = 1
    backwards: int = 0
    nonfinite: int = 0
    last: tuple[int, float, int] | None = None  # the last accepted sample: (attempt, time, step)


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) and abs(value) <= MAX_LOSS else None


class Curve:
    def __init__(self, state: CurveState | None = None, max_points: int = MAX_POINTS) -> None:
        if max_points < 2:
            raise ValueError("a curve needs room for at least 2 points")
        self.state = state if state is not None else CurveState()
        self.max_points = max_points
        while len(self.state.buckets) > max_points:
            self._halve()

    @property
    def buckets(self) -> list[Bucket]:
        return self.state.buckets

    @property
    def last_step(self) -> int | None:
        return self.buckets[-1].step if self.buckets else None

    def add(self, t: float, step: int, loss: float | None, attempt: int = 1) -> bool:
        """Fold in one sample; False when it was kept out (bad time or step, or a step going backwards)."""
        s = self.state
        if not math.isfinite(t) or not 0 <= step <= MAX_STEP:
            return False
        if loss is not None and _finite(loss) is None:
            s.nonfinite += 1
        loss = _finite(loss)
        done, span = 0, 0.0
        if s.last is not None and s.last[0] == attempt:  # steps per second within one attempt only
            _, last_t, last_step = s.last
            if step < last_step:
                s.backwards += 1
                return False
            if t > last_t:
                done, span = step - last_step, t - last_t
        s.last = (attempt, t, step)
        top = self.last_step
        if top is not None and step <= top:
            if step < top:  # a new attempt that resumed from an earlier step: kept out until it passes
                s.backwards += 1
            return False
        sample = Bucket(t=t, step=step, loss=loss, done=done, span=span, losses=0 if loss is None else 1)
        if self.buckets and self.buckets[-1].n < s.stride:
            self.buckets[-1] = merge(self.buckets[-1], sample)
        else:
            self.buckets.append(sample)
            if len(self.buckets) > self.max_points:
                self._halve()
        return True

    def _halve(self) -> None:
        b = self.state.buckets
        merged = [merge(b[i], b[i + 1]) for i in range(0, len(b) - 1, 2)]
        if len(b) % 2:
            merged.append(b[-1])
        self.state.buckets = merged
        self.state.stride *= 2

    def extend(self, later: Curve) -> None:
        """Append the buckets of a curve recorded after this one (past this one's last step)."""
        for bucket in later.buckets:
            top = self.last_step
            if top is not None and bucket.step <= top:
                continue
            self.buckets.append(bucket)
            if len(self.buckets) > self.max_points:
                self._halve()
        self.state.backwards += later.state.backwards
        self.state.nonfinite += later.state.nonfinite
        if later.state.last is not None:
            self.state.last = later.state.last


class JobFeed:
    """One job's curve, and each rank's last finite loss in the current attempt."""

    def __init__(self, curve: Curve | None = None) -> None:
        self.curve = curve if curve is not None else Curve()
        self.attempt: int | None = None
        self.leader: int | None = None  # the lowest rank that reported in this attempt
        self.losses: dict[int, float] = {}  # rank -> its last finite loss (bounded by the job's ranks)

    def report(self, t: float, attempt: int, rank: int, step: int, loss: float | None) -> bool:
        """A rank's progress report; True when it made a sample (the leading rank's reports do).

        The sample's loss is the mean of every rank's last finite loss (each at most one report
        interval old), so the same ranks count in every sample; a rank whose last loss was not
        finite counts in none until it reports a finite one again."""
        if attempt != self.attempt:
            self.attempt, self.leader, self.losses = attempt, None, {}
        if loss is not None and _finite(loss) is None:
            self.curve.state.nonfinite += 1
            self.losses.pop(rank, None)
        elif loss is not None:
            self.losses[rank] = loss
        if self.leader is None or rank < self.leader:
            self.leader = rank
        if rank != self.leader:
            return False
        values = list(self.losses.values())
        mean = math.fsum(v / len(values) for v in values) if values else None
        return self.curve.add(t, step, mean, attempt)
