"""A job's training curve through the real CLI against a real daemon: `curve` (json, csv), `plot` in the
terminal and as a PNG, `watch`'s progress line, and the curve after a daemon restart."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest
from PIL import Image

from ..conftest import running_daemon
from .test_cli import ddpctl, err, out

pytestmark = pytest.mark.anyio

STEPS = 48
LINE = (0x1F, 0x77, 0xB4)  # the curve's colour in a PNG (ddpd.cli.curves.LINE_COLOR)


def _line_columns(path: Path) -> tuple[tuple[int, int], set[int]]:
    """The picture's size, and the x of every column that has a pixel of the curve's colour."""
    with Image.open(path) as img:
        assert img.format == "PNG"
        rgb = img.convert("RGB")
        width, height = rgb.size
        px = rgb.load()
        assert px is not None
        cols = {x for x in range(width) for y in range(height)
                if all(abs(int(c) - w) <= 40 for c, w in zip(px[x, y], LINE, strict=True))}
    return (width, height), cols


async def test_curve_of_a_real_job_through_the_cli(short_tmp: Path) -> None:
    state = short_tmp / "state"
    async with running_daemon(short_tmp, "--heartbeat-interval", "0.25", state_dir=state) as d:
        # the built-in two-layer task, slowed a little so that its ranks report several times
        job = await d.run(d.spec(task="tests.tasks:slow", nproc=2, steps=STEPS, options={"step_sleep": 0.03}))
        assert job.state == "SUCCEEDED", job

        done = await ddpctl(d, "curve", job.id, "-o", "json")
        assert done.returncode == 0, err(done)
        data = json.loads(out(done))
        points = data["points"]
        steps = [p["step"] for p in points]
        assert 3 <= len(points) <= 512 and data["steps"] == STEPS and data["state"] == "SUCCEEDED"
        assert steps == sorted(set(steps)) and steps[-1] == STEPS
        assert all(isinstance(p["loss"], float) for p in points)
        assert any(p["steps_per_second"] for p in points)
        # each point the ranks' mean at its step; rates over at least 1 s or 10 steps (at most ~33 steps/s
        # here: a report right after the one before made 233,017 steps/s)
        assert points[-1]["loss"] == pytest.approx(sum(r.loss for r in job.ranks) / 2)
        assert points[0]["loss"] > 2 * points[-1]["loss"] > 0  # two-layer's MSE falls (its sum went to -1108)
        assert all(p["steps_per_second"] is None or p["steps_per_second"] < 60 for p in points), points

        done = await ddpctl(d, "curve", job.id, "-o", "csv")
        rows = list(csv.DictReader(io.StringIO(out(done))))
        assert done.returncode == 0 and [int(r["step"]) for r in rows] == steps
        assert list(rows[0]) == ["time", "step", "loss", "steps_per_second"]
        old_name = await ddpctl(d, "metrics", job.id, "-o", "csv")  # the command's former name still works
        assert old_name.returncode == 0 and out(old_name) == out(done), err(old_name)

        done = await ddpctl(d, "plot", job.id)
        assert done.returncode == 0, err(done)
        assert job.id in out(done) and "step" in out(done) and len(out(done).splitlines()) >= 10
        assert out(done).splitlines()[-1].split()[-2:] == [str(STEPS), "step"]  # whole steps, not 4.8e1

        png = short_tmp / "loss.png"
        done = await ddpctl(d, "plot", job.id, "--png", str(png), "--size", "640x400")
        assert done.returncode == 0, err(done)
        size, cols = _line_columns(png)
        assert size == (640, 400)
        assert len(cols) > 640 // 2 and min(cols) < 640 // 4 and max(cols) > 640 * 3 // 4  # a curve across it

        done = await ddpctl(d, "watch", job.id)  # a final job: one view, then its end
        assert "steps/s" in out(done) and "loss" in out(done)

        missing = await ddpctl(d, "curve", "j999-none")
        assert missing.returncode == 1 and "not_found" in err(missing)

    async with running_daemon(short_tmp, state_dir=state) as d:  # the curve outlives the daemon
        done = await ddpctl(d, "curve", job.id, "-o", "json")
        assert done.returncode == 0, err(done)
        assert [p["step"] for p in json.loads(out(done))["points"]] == steps
        assert (await ddpctl(d, "rm", job.id)).returncode == 0
        assert (await ddpctl(d, "curve", job.id)).returncode == 1
