"""How ddpctl shows a job's training curve: the progress line of `watch` (steps/s, ETA, a sparkline of
the loss), `plot` in the terminal (drawn here, by the PNG's rules) or as a PNG (matplotlib, the
optional extra ``plot``), and the export of `metrics` (CSV or JSON).
"""

from __future__ import annotations

import csv
import io
import itertools
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ddpd.client import CurvePoint, CurveResult

from . import ticks
from .words import duration_text

SPARKS = "▁▂▃▄▅▆▇█"
SPARK_WIDTH = 40
LINE_COLOR = "#1f77b4"  # the loss curve in a PNG
PNG_SIZE = (800, 480)  # pixels, by default
COLUMNS = ("time", "step", "loss", "steps_per_second")
MARKED_POINTS = 60  # a PNG marks each point of a curve this sparse


class PlotUnavailable(Exception):
    """matplotlib is not installed (the optional extra ``plot``)."""


def losses(curve: CurveResult) -> list[tuple[int, float]]:
    """(step, loss) of the points that have a loss."""
    return [(p.step, p.loss) for p in curve.points if p.loss is not None]


def sparkline(values: Sequence[float], width: int = SPARK_WIDTH) -> str:
    """The values as block characters (lowest ▁, highest █), the last `width` buckets of them."""
    if not values:
        return ""
    if len(values) > width:  # the mean of each of `width` even slices: the whole run, squeezed
        values = [sum(chunk) / len(chunk) for chunk in
                  (values[i * len(values) // width:(i + 1) * len(values) // width] for i in range(width))]
    low, high = min(values), max(values)
    if high - low <= 0:
        return SPARKS[0] * len(values)
    top = len(SPARKS) - 1
    return "".join(SPARKS[round((v - low) / (high - low) * top)] for v in values)


def rate_and_eta(curve: CurveResult) -> tuple[float | None, float | None]:
    """The latest steps per second, and the seconds left to the job's target step (None: unknown)."""
    last: CurvePoint | None = curve.points[-1] if curve.points else None
    rate = next((p.steps_per_second for p in reversed(curve.points) if p.steps_per_second), None)
    if last is None or rate is None or curve.steps is None:
        return rate, None
    return rate, max(0, curve.steps - last.step) / rate


def progress_line(curve: CurveResult, final: bool) -> str:
    """`12.5 steps/s  ETA 1m20s  loss 0.0123 ▇▆▅▃▂▁` (what is known of it; "" when nothing is)."""
    parts = []
    rate, eta = rate_and_eta(curve)
    if rate is not None:
        parts.append(f"{rate:.3g} steps/s")
    if eta is not None and not final:
        parts.append(f"ETA {duration_text(eta, whole=True)}")
    points = losses(curve)
    if points:
        parts.append(f"loss {points[-1][1]:.4g} {sparkline([v for _, v in points])}")
    return "  ".join(parts)


def to_rows(curve: CurveResult) -> list[dict[str, Any]]:
    return [{"time": p.time, "step": p.step, "loss": p.loss, "steps_per_second": p.steps_per_second}
            for p in curve.points]


def to_csv(curve: CurveResult) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    for row in to_rows(curve):
        writer.writerow({k: "" if v is None else v for k, v in row.items()})
    return out.getvalue()


def terminal_plot(curve: CurveResult, width: int | None = None, height: int | None = None,
                  color: bool = True) -> str:
    """The loss against the step for a terminal, `width` x `height` characters (default: the terminal's):
    by the PNG's rules (a log scale when a positive loss spans two decades or more), steps as whole
    numbers, and each point marked where there are few enough to tell apart. The x axis spans the
    steps run so far and the planned end is said in words in the title; the y labels carry the digits
    that tell them apart (`ticks.labels`)."""
    points = losses(curve)
    cols, rows = _terminal_size()
    log = _log_scale([v for _, v in points])
    canvas = _Canvas(max(20, (width or cols) - AXIS_WIDTH - 1), max(3, (height or min(rows, 25)) - 3),
                     [s for s, _ in points], [math.log10(v) if log else v for _, v in points])
    canvas.draw(marked=len(points) <= canvas.width // 3)
    scale = ", log scale" if log else ""
    if points and curve.steps and curve.steps > points[-1][0]:  # said, not the scale
        scale += f", step {points[-1][0]} of {curve.steps} planned"
    lines = [f"{curve.job_id} loss ({curve.state}{scale})"]
    labels = canvas.y_labels(log)
    for row, text in enumerate(canvas.rows()):
        lines.append(f"{labels.get(row, ''):>{AXIS_WIDTH - 1}} ┤{_blue(text, color)}")
    lines.append(" " * (AXIS_WIDTH - 1) + " └" + "─" * canvas.width)
    lines.append(" " * (AXIS_WIDTH + 1) + canvas.x_labels() + "  step")
    return "\n".join(lines)


AXIS_WIDTH = 10  # characters left of a terminal plot's y axis
LINE, MARK = "·", "●"


def _blue(text: str, color: bool) -> str:
    return f"\x1b[34m{text}\x1b[0m" if color and text.strip() else text


class _Canvas:
    """A character grid the curve is drawn on: x the step, y the loss (or its log10), both linear."""

    def __init__(self, width: int, height: int, xs: list[int], ys: list[float]) -> None:
        self.width, self.height, self.xs, self.ys = width, height, xs, ys
        self.x0, self.x1 = (min(xs), max(xs)) if xs else (0, 1)
        if self.x1 == self.x0:
            self.x1 = self.x0 + 1
        low, high = (min(ys), max(ys)) if ys else (0.0, 1.0)
        pad = 0.5 if high == low else 0.0
        self.y0, self.y1 = low - pad, high + pad
        self.grid = [[" "] * width for _ in range(height)]

    def col(self, x: float) -> int:
        return round((x - self.x0) / (self.x1 - self.x0) * (self.width - 1))

    def row(self, y: float) -> int:
        return round((self.y1 - y) / (self.y1 - self.y0) * (self.height - 1))

    def draw(self, marked: bool) -> None:
        pairs = list(zip(self.xs, self.ys, strict=True))
        for (xa, ya), (xb, yb) in itertools.pairwise(pairs):
            ca, cb, last = self.col(xa), self.col(xb), self.row(ya)
            for c in range(ca, cb + 1):
                r = self.row(ya + (yb - ya) * ((c - ca) / (cb - ca) if cb > ca else 1.0))
                for between in range(min(last, r), max(last, r) + 1):  # a steep drop stays joined
                    self.grid[between][c] = LINE
                last = r
        for x, y in pairs if marked or len(pairs) == 1 else pairs[-1:]:
            self.grid[self.row(y)][self.col(x)] = MARK

    def rows(self) -> list[str]:
        return ["".join(cells).rstrip() for cells in self.grid]

    def y_labels(self, log: bool) -> dict[int, str]:
        """The loss at the top, middle and bottom rows, by row (a loss from 1.0051 to 1.0037 read
        1.01, 1, 1 with three fixed digits)."""
        rows = sorted({0, self.height // 2, self.height - 1})
        values = [self.y1 - (self.y1 - self.y0) * row / (self.height - 1) for row in rows]
        return dict(zip(rows, ticks.labels([10**v if log else v for v in values]), strict=True))

    def x_labels(self) -> str:
        """The first, middle and last step under the axis, as whole numbers."""
        line = [" "] * (self.width + 8)
        for x in (self.x0, (self.x0 + self.x1) // 2, self.x1):
            text = str(x)
            at = min(max(0, self.col(x) - len(text) // 2), len(line) - len(text))
            line[at:at + len(text)] = text
        return "".join(line).rstrip()


def _terminal_size() -> tuple[int, int]:
    try:
        size = os.get_terminal_size()
        return size.columns, size.lines - 2
    except OSError:
        return 100, 25


def write_png(curve: CurveResult, path: Path, size: tuple[int, int] = PNG_SIZE) -> None:
    """The loss against the step as a PNG of `size` pixels (matplotlib, Agg); PlotUnavailable without it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise PlotUnavailable(f"--png needs matplotlib, the optional extra 'plot': pip install 'ddpd[plot]' "
                              f"({exc})") from None
    points = losses(curve)
    dpi = 100
    fig = Figure(figsize=(size[0] / dpi, size[1] / dpi), dpi=dpi)
    ax = fig.add_subplot()
    ax.plot([s for s, _ in points], [v for _, v in points], color=LINE_COLOR, linewidth=2, label="loss")
    if points and len(points) <= MARKED_POINTS:  # sparse: each point shown, not only the line
        ax.plot([s for s, _ in points], [v for _, v in points], "o", color=LINE_COLOR, markersize=5)
    if _log_scale([v for _, v in points]):
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"{curve.job_id} loss ({curve.state})")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=dpi)


def _log_scale(values: Sequence[float]) -> bool:
    """The one rule of both plots: a log scale when every loss is positive and they span two decades."""
    return bool(values) and min(values) > 0 and math.log10(max(values) / min(values)) >= 2


def parse_size(text: str, low: int = 100, high: int = 10_000, unit: str = "pixels") -> tuple[int, int]:
    """`WIDTHxHEIGHT`, each `low`..`high` (pixels for a PNG, characters for the terminal); ValueError
    naming the problem."""
    w, sep, h = text.lower().partition("x")
    if not sep or not w.isdigit() or not h.isdigit():
        raise ValueError(f"{text!r} is not WIDTHxHEIGHT ({unit})")
    width, height = int(w), int(h)
    if not (low <= width <= high and low <= height <= high):
        raise ValueError(f"{text!r}: each side must be {low} to {high} {unit}")
    return width, height


def parse_terminal_size(text: str) -> tuple[int, int]:
    """`COLUMNSxROWS` of a terminal plot, in characters."""
    return parse_size(text, 10, 1000, "characters")
