"""The loss curve as SVG, drawn here so the page needs no chart library.

The loss against the step as one polyline over a frame with a few labelled ticks (log scale when
the loss spans two decades or more), and the steps per second as a faint line on its own scale.
The x axis spans the steps run so far; a job's planned end is said in words under it, never used as
the scale (a job 450 steps into 400,000 was a vertical line at the left edge). Tick labels carry the
digits their range needs (`ticks.labels`). Only numbers and fixed words go into the SVG; the caller's
text is never drawn into it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ddpd.client import CurveResult

from .. import ticks as tick_marks

WIDTH, HEIGHT = 720, 260
LEFT, RIGHT, TOP, BOTTOM = 64, 56, 14, 34  # margins for the tick labels
TICKS = 5


def _fmt(value: float) -> str:
    return f"{value:.3g}"


class _Scale:
    """Maps values in [low, high] onto pixels [a, b] (linear or log10)."""

    def __init__(self, low: float, high: float, a: float, b: float, log: bool = False,
                 whole: bool = False) -> None:
        self.log, self.whole = log, whole
        self.low, self.high = (math.log10(low), math.log10(high)) if log else (low, high)
        if self.high <= self.low:
            self.low, self.high = self.low - 1, self.high + 1
        self.a, self.b = a, b

    def __call__(self, value: float) -> float:
        v = math.log10(value) if self.log else value
        return self.a + (v - self.low) / (self.high - self.low) * (self.b - self.a)

    def ticks(self) -> list[float]:
        """Round values on a linear scale; on a log scale, evenly spaced in the exponent."""
        if not self.log:
            return tick_marks.nice(self.low, self.high, TICKS, whole=self.whole)
        return [10 ** (self.low + (self.high - self.low) * i / (TICKS - 1)) for i in range(TICKS)]


def _polyline(xs: Sequence[float], ys: Sequence[float], cls: str) -> str:
    points = " ".join(f"{x:.1f},{y:.1f}" for x, y in zip(xs, ys, strict=True))
    return f'<polyline class="{cls}" points="{points}"/>'


def loss_svg(curve: CurveResult) -> str:
    """The chart of `curve`; a frame saying "no loss yet" when it has no point with a loss."""
    points = [(p.step, p.loss) for p in curve.points if p.loss is not None and math.isfinite(p.loss)]
    head = (f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="loss against step" '
            f'data-points="{len(points)}" xmlns="http://www.w3.org/2000/svg">')
    frame = (f'<rect class="frame" x="{LEFT}" y="{TOP}" width="{WIDTH - LEFT - RIGHT}" '
             f'height="{HEIGHT - TOP - BOTTOM}"/>')
    if not points:
        return (f'{head}{frame}<text class="empty" x="{WIDTH / 2}" y="{HEIGHT / 2}" '
                f'text-anchor="middle">no loss yet</text></svg>')
    steps = [s for s, _ in points]
    losses = [v for _, v in points]
    log = min(losses) > 0 and math.log10(max(losses) / min(losses)) >= 2
    ran = [s for s, _ in _rates(curve)] + steps  # the steps run so far, not the planned end
    x = _Scale(min(ran), max(ran), LEFT, WIDTH - RIGHT, whole=True)
    y = _Scale(min(losses), max(losses), HEIGHT - BOTTOM, TOP, log=log)
    planned = curve.steps if curve.steps is not None and curve.steps > max(ran) else None
    parts = [head, frame, *_axes(x, y, planned), _polyline([x(s) for s in steps], [y(v) for v in losses], "loss")]
    parts.append(f'<circle class="last" cx="{x(steps[-1]):.1f}" cy="{y(losses[-1]):.1f}" r="3"/>')
    parts.extend(_rate_line(curve, x))
    parts.append("</svg>")
    return "".join(parts)


def _axes(x: _Scale, y: _Scale, planned: int | None) -> list[str]:
    out = []
    for step in sorted({round(v) for v in x.ticks()}):  # steps are whole: no tick twice
        out.append(f'<text class="tick" x="{x(step):.1f}" y="{HEIGHT - BOTTOM + 16}" text-anchor="middle">'
                   f'{step}</text>')
    values = y.ticks()
    for value, label in zip(values, tick_marks.labels(values), strict=True):
        py = y(value)
        out.append(f'<line class="grid" x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{py:.1f}" y2="{py:.1f}"/>')
        out.append(f'<text class="tick" x="{LEFT - 6}" y="{py + 4:.1f}" text-anchor="end">{label}</text>')
    words = "step" if planned is None else f"step (of {planned} planned)"
    out.append(f'<text class="label" x="{WIDTH - RIGHT}" y="{HEIGHT - 4}" text-anchor="end">{words}</text>')
    out.append(f'<text class="label" x="4" y="{TOP + 10}">loss</text>')
    return out


def _rates(curve: CurveResult) -> list[tuple[int, float]]:
    return [(p.step, p.steps_per_second) for p in curve.points
            if p.steps_per_second is not None and math.isfinite(p.steps_per_second)]


def _rate_line(curve: CurveResult, x: _Scale) -> list[str]:
    rates = _rates(curve)
    if len(rates) < 2:
        return []
    top = max(r for _, r in rates)
    y = _Scale(0.0, top, HEIGHT - BOTTOM, TOP)
    return [_polyline([x(s) for s, _ in rates], [y(r) for _, r in rates], "rate"),
            f'<text class="tick rate-label" x="{WIDTH - RIGHT + 6}" y="{TOP + 10}">{_fmt(top)}/s</text>']
