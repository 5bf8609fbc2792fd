"""How ddpctl shows a job's training curve: the progress line of `watch` (steps/s, ETA, a sparkline of the
loss), `plot` in the terminal (plotext) or as a PNG (matplotlib, the optional extra ``plot``), and the
export of `metrics` (CSV or JSON).
"""

from __future__ import annotations

import csv
import io
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ddpd.client import CurvePoint, CurveResult

from .render import duration_text

SPARKS = "▁▂▃▄▅▆▇█"
SPARK_WIDTH = 40
LINE_COLOR = "#1f77b4"  # the loss curve in a PNG
PNG_SIZE = (800, 480)  # pixels, by default
COLUMNS = ("time", "step", "loss", "steps_per_second")


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
    """The loss against the step, drawn with plotext (braille dots joined by lines) for a terminal."""
    import plotext

    points = losses(curve)
    cols, rows = _terminal_size()
    fig = plotext.figure
    fig.clear()
    fig.plot_size(width or cols, height or min(rows, 25))
    signal = fig.signal([s for s, _ in points], [v for _, v in points], marker="braille")
    signal.lines()
    fig.draw(signal)
    fig.title(f"{curve.job_id} loss ({curve.state})")
    fig.label("step", axis="x")
    text: str = fig.build().string(colorless=not color)
    fig.clear()
    return text


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
    if points and min(v for _, v in points) > 0 and _spans_decades([v for _, v in points]):
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"{curve.job_id} loss ({curve.state})")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=dpi)


def _spans_decades(values: Sequence[float]) -> bool:
    return math.log10(max(values) / min(values)) >= 2


def parse_size(text: str) -> tuple[int, int]:
    """`WIDTHxHEIGHT` in pixels, each 100..10000; ValueError naming the problem."""
    w, sep, h = text.lower().partition("x")
    if not sep or not w.isdigit() or not h.isdigit():
        raise ValueError(f"{text!r} is not WIDTHxHEIGHT (pixels)")
    width, height = int(w), int(h)
    if not (100 <= width <= 10_000 and 100 <= height <= 10_000):
        raise ValueError(f"{text!r}: each side must be 100 to 10000 pixels")
    return width, height
