"""How ddpctl shows a curve: the sparkline, watch's progress line (steps/s, ETA), the CSV export, the
PNG size option, and the clear error when matplotlib (the extra 'plot') is missing."""

from __future__ import annotations

import csv
import io
import sys
from pathlib import Path

import pytest

from ddpd.cli import curves
from ddpd.client import CurvePoint, CurveResult


def curve(steps: int | None = 100, state: str = "RUNNING") -> CurveResult:
    points = [CurvePoint(time=1000.0 + i, step=10 * i, loss=1.0 / i, steps_per_second=10.0) for i in range(1, 6)]
    points.append(CurvePoint(time=1006.0, step=55, loss=None, steps_per_second=5.0))
    return CurveResult(job_id="j3-abcd", state=state, points=points, steps=steps)


def test_sparkline_spans_lowest_to_highest_and_squeezes_long_runs() -> None:
    assert curves.sparkline([3.0, 2.0, 1.0]) == "█▅▁"
    assert curves.sparkline([1.0, 1.0]) == "▁▁"
    assert curves.sparkline([]) == ""
    line = curves.sparkline([float(i) for i in range(1000)], width=20)
    assert len(line) == 20 and line[0] == "▁" and line[-1] == "█"


def test_progress_line_has_rate_eta_and_the_loss() -> None:
    line = curves.progress_line(curve(), final=False)
    assert line.startswith("5 steps/s  ETA 9s  loss 0.2 ")  # 45 steps left at 5 steps/s
    assert line.endswith("█▄▂▁▁")
    assert "ETA" not in curves.progress_line(curve(steps=None), final=False)  # a script: no target
    assert "ETA" not in curves.progress_line(curve(), final=True)
    assert curves.progress_line(CurveResult(job_id="j", state="QUEUED", points=[]), final=False) == ""


def test_csv_has_a_header_and_empty_cells_for_unknowns() -> None:
    rows = list(csv.DictReader(io.StringIO(curves.to_csv(curve()))))
    assert [r["step"] for r in rows] == ["10", "20", "30", "40", "50", "55"]
    assert rows[-1]["loss"] == "" and float(rows[0]["steps_per_second"]) == 10.0


def test_png_size_is_checked() -> None:
    assert curves.parse_size("640x400") == (640, 400)
    for bad in ("640", "x", "50x400", "640x99999", "-1x5"):
        with pytest.raises(ValueError, match=r"pixels|WIDTHxHEIGHT"):
            curves.parse_size(bad)


def test_terminal_plot_draws_the_curve() -> None:
    text = curves.terminal_plot(curve(), width=60, height=15, color=False)
    assert "j3-abcd loss (RUNNING, step 50 of 100 planned)" in text and "step" in text and len(text.splitlines()) == 15
    assert all(line == line.rstrip() and len(line) <= 60 + 8 for line in text.splitlines())


def test_terminal_plot_follows_the_png_rules() -> None:
    """Bug: a loss from 8 to 0.0004 was drawn flat (no log scale) and steps labelled 1.0e0 8.1e2."""
    points = [CurvePoint(time=0.0, step=s, loss=v, steps_per_second=None)
              for s, v in [(1, 8.0), (100, 0.5), (400, 0.004), (810, 0.0004)]]
    text = curves.terminal_plot(CurveResult(job_id="j", state="SUCCEEDED", points=points), 60, 14, color=False)
    title, *plot, _, labels = text.splitlines()
    assert title == "j loss (SUCCEEDED, log scale)" and labels.split() == ["1", "405", "810", "step"]
    marks = [(row, line.index("●")) for row, line in enumerate(plot) if "●" in line]
    assert len(marks) == 4 and [r for r, _ in marks] == sorted(r for r, _ in marks)  # each point, falling
    assert marks[1][0] - marks[0][0] >= 2 and marks[3][0] - marks[2][0] >= 2  # log: every decade gets rows
    assert plot[0].split("┤")[0].strip() == "8" and plot[-1].split("┤")[0].strip() == "0.0004"
    dense = [CurvePoint(time=0.0, step=s, loss=-s / 7, steps_per_second=None) for s in range(1, 400)]
    text = curves.terminal_plot(CurveResult(job_id="j", state="RUNNING", points=dense), 60, 14, color=False)
    assert "log scale" not in text and text.count("●") == 1  # dense: the line, and the last point marked


def test_missing_matplotlib_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as where it is not installed: import fails
    with pytest.raises(curves.PlotUnavailable, match=r"pip install 'ddpd\[plot\]'"):
        curves.write_png(curve(), tmp_path / "x.png")
