"""ddpctl's pure parts: what a cancel says it did, the spec that submit's options build, and how log
lines are written."""

from __future__ import annotations

import os
import re
import time
from datetime import UTC, datetime
from pathlib import Path

import click
import msgspec
import pytest

from ddpd.cli.output import LogWriter
from ddpd.cli.render import cancel_line
from ddpd.cli.specs import spec_from_options, typed_value
from ddpd.client import CancelResult, JobSpec, JobView, LogChunk, SpecError, Timeouts


def view(state: str, spec: JobSpec | None = None) -> JobView:
    return JobView(id="j3", name="", state=state, owner_uid=0, submitted_at=0.0, spec=spec or JobSpec())


def test_cancel_says_what_it_did() -> None:
    assert cancel_line(CancelResult("cancelled", view("CANCELLED"))) == "cancelled j3 (was QUEUED)"
    graced = JobSpec(timeouts=Timeouts(kill_grace=7.5))
    assert cancel_line(CancelResult("stopping", view("RUNNING", graced))) == (
        "stopping j3: ranks asked to stop, teardown within 7.5s")
    assert cancel_line(CancelResult("stopping", view("RUNNING"))).endswith("within the daemon's kill grace")
    assert cancel_line(CancelResult("killing", view("RUNNING"))) == "killing j3"


def test_submit_options_build_the_spec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    spec = spec_from_options({"nproc": 2, "kill_grace": 3.0, "env": ("A=1",), "options": ("lr=0.1", "x=yes"),
                              "task": None}, ("train.py", "--lr", "1"))
    assert spec.script == [str(tmp_path / "train.py"), "--lr", "1"] and spec.module is False
    assert spec.nproc == 2 and spec.timeouts.kill_grace == 3.0 and spec.env == {"A": "1"}
    assert spec.options == {"lr": 0.1, "x": "yes"} and spec.workdir == os.fspath(tmp_path)
    assert spec_from_options({}, ("-m", "pkg.mod", "--steps", "1")).script == ["pkg.mod", "--steps", "1"]
    assert spec_from_options({"module": True}, ("pkg.mod", "--", "a")).script == ["pkg.mod", "a"]
    assert [typed_value(t) for t in ("true", "3", "-2.5e1", "abc")] == [True, 3, -25.0, "abc"]
    with pytest.raises(click.BadParameter, match="KEY=VALUE"):
        spec_from_options({"env": ("NOEQUALS",)}, ())
    with pytest.raises(SpecError) as caught:
        spec_from_options({"nproc": 0}, ())
    assert caught.value.field == "nproc"


def test_a_waiting_job_says_on_what_and_after_takes_lists() -> None:
    from rich.console import Console

    from ddpd.cli.render import job_detail

    waiting = JobView(id="j5-aaaa", name="", state="QUEUED", owner_uid=0, submitted_at=0.0,
                      spec=JobSpec(after=["j3-bbbb", "j4-cccc"]), waiting_on=["j4-cccc"])
    console = Console(width=120, record=True)
    console.print(job_detail(waiting, 1.0))
    text = console.export_text()
    assert "after       j3-bbbb, j4-cccc" in text and "waiting on  j4-cccc" in text
    spec = spec_from_options({"after": ("j3,j4", " j5 ")}, ())
    assert spec.after == ["j3", "j4", "j5"]


def test_log_lines_get_their_rank_and_stamp_and_partial_lines_wait_per_stream(
        capsys: pytest.CaptureFixture[str]) -> None:
    when = datetime(2026, 12, 3, 17, 35, 44, 250_000, tzinfo=UTC).timestamp()
    writer = LogWriter(prefix=True, timestamps=True)
    writer.write(LogChunk(rank=1, attempt=1, text="out 1\nout par", stream="stdout", time=when))
    writer.write(LogChunk(rank=1, attempt=1, text="err 1\n", stream="stderr", time=when))
    writer.write(LogChunk(rank=1, attempt=1, text="t\n", stream="stdout", time=when + 1))
    writer.finish()
    assert capsys.readouterr().out.splitlines() == [
        "2026-12-03T17:35:44.250Z [rank 1] out 1",
        "2026-12-03T17:35:44.250Z [rank 1] err 1",
        "2026-12-03T17:35:45.250Z [rank 1] out part",  # a line takes the stamp of the chunk that ends it
    ]
    plain = LogWriter(prefix=False)
    plain.write(LogChunk(rank=0, attempt=1, text="as is", stream="stdout", time=when))
    plain.finish()
    assert capsys.readouterr().out == "as is"  # no prefix and no stamp: the text as written


def test_watch_shows_active_jobs_first_with_step_and_eta_then_history() -> None:
    from rich.console import Console

    from ddpd.cli.watch import watch_view
    from ddpd.client import RankView

    now = time.time()
    done = msgspec.structs.replace(view("SUCCEEDED"), id="j1-old", started_at=now - 200, finished_at=now - 150)
    rank = RankView(rank=0, state="TRAINING", attempt=1, step=50)
    running = msgspec.structs.replace(view("RUNNING", JobSpec(steps=200)), id="j2-run", started_at=now - 100,
                                      ranks=[rank])
    queued = msgspec.structs.replace(view("QUEUED"), id="j3-new", pending="resources: needs 1 CPU slots, 0 of 1 free")
    console = Console(width=200, record=True)
    with console.capture() as captured:
        console.print(watch_view([queued, running, done], single=False))
    text = captured.get()
    assert text.index("j3-new") < text.index("j2-run") < text.index("history") < text.index("j1-old")
    assert re.search(r"50/200 │ +(4m5\d|5m0\d)s", text), text  # 150 steps left at 50 per 100 s
    assert "resources: needs 1 CPU slots" in text
