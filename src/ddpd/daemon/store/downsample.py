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

`JobFeed` turns the progress reports of a job's ranks into samples: a sample per step the lowest
rank that reports (normally rank 0) reported, its loss the mean of the finite losses the ranks
reported at that same step.

Steps per second are measured over a trailing window of at least RATE_SECONDS or RATE_STEPS (the
samples of the attempt kept in `recent`), never over two reports a few microseconds apart.
"""

from __future__ import annotations

import math

import msgspec

MAX_POINTS = 512
MAX_STEP = 2**63 - 1
RATE_SECONDS, RATE_STEPS = 1.0, 10  # steps per second are measured over at least one of these
MAX_RECENT = 64  # samples kept for that window
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
    recent: list[tuple[float, int]] = msgspec.field(default_factory=list)  # (time, step) of the attempt's window


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
        if s.last is not None and s.last[0] == attempt and step < s.last[2]:
            s.backwards += 1
            return False
        if s.last is None or s.last[0] != attempt:  # steps per second within one attempt only
            s.recent = []
        done, span = self._window(t, step)
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

    def _window(self, t: float, step: int) -> tuple[int, float]:
        """Steps done and seconds over the trailing window that ends at this sample: from the latest
        earlier sample of the attempt at least RATE_SECONDS or RATE_STEPS back ((0, 0): none yet)."""
        recent = self.state.recent
        anchor = self.anchor(t, step)
        recent.append((t, step))
        while len(recent) > 2 and (t - recent[1][0] >= RATE_SECONDS or step - recent[1][1] >= RATE_STEPS):
            del recent[0]  # its successor is far enough back for every later sample
        del recent[:-MAX_RECENT]
        if anchor is None or t <= anchor[0]:
            return 0, 0.0
        return step - anchor[1], t - anchor[0]

    def anchor(self, t: float, step: int) -> tuple[float, int] | None:
        """The latest sample of the attempt at least RATE_SECONDS or RATE_STEPS before (t, step)."""
        return next(((rt, rs) for rt, rs in reversed(self.state.recent)
                     if t - rt >= RATE_SECONDS or step - rs >= RATE_STEPS), None)

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


MAX_PENDING = 8  # leader steps waiting for the other ranks' losses (a rank that stopped reporting)
MAX_EARLY = 16  # losses a rank reported for steps its leader has not reported yet, per rank


class JobFeed:
    """One job's curve, fed by its ranks' reports: a point per step the leading rank reports (the
    lowest rank that reports in the attempt), its loss the mean of the losses the ranks reported *at
    that step* (never a rank's older loss beside another's newer one).

    A step's point waits (pending) until every rank seen in the attempt has reported that step or a
    later one, and until the leader has reported a later step or a rank's result came: so the first
    point is not one rank's loss because the others had not yet spoken. A rank that stops reporting
    holds no more than MAX_PENDING points back."""

    def __init__(self, curve: Curve | None = None) -> None:
        self.curve = curve if curve is not None else Curve()
        self.attempt: int | None = None
        self.leader: int | None = None
        self.reached: dict[int, int] = {}  # rank -> the highest step it reported (bounded by the job's ranks)
        self.pending: dict[int, tuple[float, dict[int, float | None]]] = {}  # step -> (time, rank -> loss)
        self.early: dict[int, dict[int, float | None]] = {}  # rank -> step -> loss, ahead of the leader

    def report(self, t: float, attempt: int, rank: int, step: int, loss: float | None, final: bool = False) -> bool:
        """A rank's progress report (`final`: its result); True when a point was added to the curve."""
        if attempt != self.attempt:
            added = self._commit(final=True)
            self.attempt, self.leader, self.reached, self.pending, self.early = attempt, None, {}, {}, {}
        else:
            added = False
        if loss is not None and _finite(loss) is None:
            self.curve.state.nonfinite += 1
            loss = None
        self.reached[rank] = max(step, self.reached.get(rank, step))
        if self.leader is None or rank < self.leader:
            self.leader = rank
        if rank == self.leader:
            self._lead(t, rank, step, loss)
        elif step in self.pending:
            self.pending[step][1][rank] = loss
        else:
            ahead = self.early.setdefault(rank, {})
            ahead[step] = loss
            while len(ahead) > MAX_EARLY:
                del ahead[min(ahead)]
        return self._commit(final) or added

    def latest(self) -> Bucket | None:
        """The newest point, the one still pending included (live metrics: not a report behind)."""
        last = self.curve.buckets[-1] if self.curve.buckets else None
        if not self.pending:
            return last
        step = max(self.pending)
        t, losses = self.pending[step]
        values = [v for v in losses.values() if v is not None]
        loss = math.fsum(v / len(values) for v in values) if values else None
        last_sample = self.curve.state.last
        same = last_sample is not None and last_sample[0] == (self.attempt or 0)  # rates within one attempt
        anchor = self.curve.anchor(t, step) if same else None
        done, span = (step - anchor[1], t - anchor[0]) if anchor is not None and t > anchor[0] else (0, 0.0)
        return Bucket(t=t, step=step, loss=loss, done=done, span=span)

    def finish(self) -> bool:
        """The job ended: every pending point goes in with the losses it has."""
        added = False
        while self.pending:
            added |= self._commit(final=True, force=True)
        return added

    def _lead(self, t: float, rank: int, step: int, loss: float | None) -> None:
        seen = {r: ahead.pop(step) for r, ahead in self.early.items() if step in ahead}
        if step in self.pending:  # the leader reports a step again (its result after its progress): the
            self.pending[step][1].update({**seen, rank: loss})  # other ranks' losses at it stay
        else:
            self.pending[step] = (t, {**seen, rank: loss})

    def _commit(self, final: bool, force: bool = False) -> bool:
        """Add the pending points every rank has passed (the newest only once the leader moved on, or
        at a result), oldest first; past MAX_PENDING (or `force`), the oldest with the losses it has."""
        added = False
        for step in sorted(self.pending):
            newest = step == max(self.pending)
            passed = all(reached >= step for reached in self.reached.values()) and (final or not newest)
            if not passed and not force and len(self.pending) <= MAX_PENDING:
                break
            t, losses = self.pending.pop(step)
            values = [v for v in losses.values() if v is not None]
            mean = math.fsum(v / len(values) for v in values) if values else None
            added |= self.curve.add(t, step, mean, self.attempt or 0)
            for ahead in self.early.values():
                for old in [s for s in ahead if s <= step]:
                    del ahead[old]
        return added
