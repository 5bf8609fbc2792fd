"""The loss curve as SVG, drawn here so the page needs no chart library.

The loss against the step as one polyline over a frame with a few labelled ticks (log scale when
the loss spans two decades or more), and the steps per second as a faint line on its own scale.
Only numbers and fixed words go into the SVG; the caller's text is never drawn into it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ddpd.client import CurveResult

WIDTH, HEIGHT = 720, 260
LEFT, RIGHT, TOP, BOTTOM = 64, 56, 14, 34  # margins for the tick labels
TICKS = 5


def _ticks(low: float, high: float) -> list[float]:
    if high <= low:
        return [low]
    return [low + (high - low) * i / (TICKS - 1) for i in range(TICKS)]


def _fmt(value: float) -> str:
    return f"{value:.3g}"


class _Scale:
    """Maps values in [low, high] onto pixels [a, b] (linear or log10)."""

    def __init__(self, low: float, high: float, a: float, b: float, log: bool = False) -> None:
        self.log = log
        self.low, self.high = (math.log10(low), math.log10(high)) if log else (low, high)
        if self.high <= self.low:
            self.low, self.high = self.low - 1, self.high + 1
        self.a, self.b = a, b

    def __call__(self, value: float) -> float:
        v = math.log10(value) if self.log else value
        return self.a + (v - self.low) / (self.high - self.low) * (self.b - self.a)

    def ticks(self) -> list[float]:
        marks = _ticks(self.low, self.high)
        return [10**m for m in marks] if self.log else marks


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
    x = _Scale(min(steps), max(max(steps), curve.steps or 0), LEFT, WIDTH - RIGHT)
    y = _Scale(min(losses), max(losses), HEIGHT - BOTTOM, TOP, log=log)
    parts = [head, frame, *_axes(x, y), _polyline([x(s) for s in steps], [y(v) for v in losses], "loss")]
    parts.append(f'<circle class="last" cx="{x(steps[-1]):.1f}" cy="{y(losses[-1]):.1f}" r="3"/>')
    parts.extend(_rate_line(curve, x))
    parts.append("</svg>")
    return "".join(parts)


def _axes(x: _Scale, y: _Scale) -> list[str]:
    out = []
    for step in sorted({round(v) for v in x.ticks()}):  # steps are whole: no tick twice
        out.append(f'<text class="tick" x="{x(step):.1f}" y="{HEIGHT - BOTTOM + 16}" text-anchor="middle">'
                   f'{step}</text>')
    for value in y.ticks():
        py = y(value)
        out.append(f'<line class="grid" x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{py:.1f}" y2="{py:.1f}"/>')
        out.append(f'<text class="tick" x="{LEFT - 6}" y="{py + 4:.1f}" text-anchor="end">{_fmt(value)}</text>')
    out.append(f'<text class="label" x="{WIDTH - RIGHT}" y="{HEIGHT - 4}" text-anchor="end">step</text>')
    out.append(f'<text class="label" x="4" y="{TOP + 10}">loss</text>')
    return out


def _rate_line(curve: CurveResult, x: _Scale) -> list[str]:
    rates = [(p.step, p.steps_per_second) for p in curve.points
             if p.steps_per_second is not None and math.isfinite(p.steps_per_second)]
    if len(rates) < 2:
        return []
    top = max(r for _, r in rates)
    y = _Scale(0.0, top, HEIGHT - BOTTOM, TOP)
    return [_polyline([x(s) for s, _ in rates], [y(r) for _, r in rates], "rate"),
            f'<text class="tick rate-label" x="{WIDTH - RIGHT + 6}" y="{TOP + 10}">{_fmt(top)}/s</text>']
