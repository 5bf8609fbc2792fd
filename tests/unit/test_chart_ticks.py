"""The loss charts' axes: the terminal plot and the web view's SVG label distinct ticks with the
digits their range needs, and scale the x axis to the steps run so far (a long planned job is said in
words, never used as the scale)."""

from __future__ import annotations

import re

from ddpd.cli import curves, ticks
from ddpd.cli.web.chart import WIDTH, loss_svg
from ddpd.client import CurvePoint, CurveResult

PLANNED = 400_000


def narrow(run: int = 450) -> CurveResult:
    """An `mlp` job early on: its loss from 1.0051 to 1.0037 over `run` of PLANNED steps."""
    points = [CurvePoint(time=float(i), step=i, loss=1.0051 - 0.0014 * (i - 1) / (run - 1), steps_per_second=12.0)
              for i in range(1, run + 1)]
    return CurveResult(job_id="j7-mlp", state="RUNNING", points=points, steps=PLANNED)


def test_labels_take_the_digits_that_tell_values_apart() -> None:
    """Bug: three fixed significant digits labelled 1.0051, 1.0044, 1.0037 as 1.01, 1, 1."""
    assert ticks.labels([1.0051, 1.0044, 1.0037]) == ["1.0051", "1.0044", "1.0037"]
    assert ticks.labels([8.0, 0.5, 0.0004]) == ["8", "0.5", "0.0004"]  # wide: no digits added
    assert ticks.labels([2.0, 2.0, 1.0]) == ["2", "2", "1"]  # equal values stay equal
    assert ticks.labels([-0.0, 1.0]) == ["0", "1"]
    close = [1 + k * 1e-12 for k in range(3)]
    assert len(set(ticks.labels(close))) == 3


def test_nice_ticks_are_round_and_inside_the_range() -> None:
    assert ticks.nice(1.0037, 1.0051) == [1.004, 1.0045, 1.005]
    assert ticks.nice(1, 450, whole=True) == [100, 200, 300, 400]
    assert ticks.nice(0.1, 0.5) == [0.1, 0.2, 0.3, 0.4, 0.5]  # no 0.30000000000000004
    assert ticks.nice(3, 3) == [3]
    assert ticks.nice(0, 1, whole=True) == [0, 1]


def test_terminal_plot_of_a_narrow_loss_and_a_long_planned_job() -> None:
    text = curves.terminal_plot(narrow(), width=70, height=12, color=False)
    title, *_, plot_end, axis = text.splitlines()
    labelled = [line.split("┤")[0].strip() for line in text.splitlines()[1:-2]]
    assert [label for label in labelled if label] == ["1.0051", "1.0044", "1.0037"]
    assert axis.split()[:3] == ["1", "225", "450"]  # the steps run, not the 400000 planned
    assert axis.endswith("  step") and title == f"j7-mlp loss (RUNNING, step 450 of {PLANNED} planned)"
    mark_row = next(line for line in text.splitlines() if "●" in line)
    assert mark_row.index("●") >= len(plot_end) - 2  # the last step run is at the right edge


def test_terminal_plot_says_no_plan_when_the_job_is_past_it_or_has_none() -> None:
    done = CurveResult(job_id="j", state="SUCCEEDED", points=narrow(20).points, steps=20)
    script = CurveResult(job_id="j", state="RUNNING", points=narrow(20).points, steps=None)
    for curve in (done, script):
        assert "planned" not in curves.terminal_plot(curve, 60, 10, color=False)


def _texts(svg: str, cls: str) -> list[tuple[float, float, str]]:
    pattern = rf'<text class="{cls}" x="([\d.]+)" y="([\d.]+)"[^>]*>([^<]*)</text>'
    return [(float(x), float(y), text) for x, y, text in re.findall(pattern, svg)]


def test_web_chart_of_a_narrow_loss_and_a_long_planned_job() -> None:
    svg = loss_svg(narrow())
    ticks_ = _texts(svg, "tick")
    y_labels = [text for x, _, text in ticks_ if x < 64]  # right-aligned left of the frame
    x_ticks = [(x, text) for x, y, text in ticks_ if y > 200 and x >= 64]
    assert y_labels == ["1.004", "1.0045", "1.005"]
    assert all(1.0037 <= float(v) <= 1.0051 for v in y_labels)
    assert [text for _, text in x_ticks] == ["100", "200", "300", "400"]
    assert x_ticks[-1][0] > WIDTH / 2  # step 400 of 450 run sits near the right, not at the left edge
    last = re.search(r'<circle class="last" cx="([\d.]+)"', svg)
    assert last is not None and float(last.group(1)) == WIDTH - 56  # the last step run ends the axis
    assert next(t for _, _, t in _texts(svg, "label")) == f"step (of {PLANNED} planned)"


def test_web_chart_without_a_plan_ahead_says_step() -> None:
    svg = loss_svg(CurveResult(job_id="j", state="SUCCEEDED", points=narrow(30).points, steps=30))
    assert next(t for _, _, t in _texts(svg, "label")) == "step"
