"""A failing rank's traceback from the user's first frame: runpy's and ddpd's frames trimmed from
its head, the user's frames and chained exceptions kept, all of it when no user frame exists."""

from __future__ import annotations

import os
import runpy
import traceback
from pathlib import Path

import pytest

import ddpd
from ddpd.worker.tracebacks import is_runner, user_frames, user_traceback

SCRIPT = """\
def load_batch():
    try:
        {{}}["batch"]
    except KeyError as exc:
        raise ValueError("bad batch") from exc

load_batch()
"""


def _raised_through_runpy(tmp_path: Path) -> BaseException:
    path = tmp_path / "train.py"
    path.write_text(SCRIPT.format())
    with pytest.raises(ValueError, match="bad batch") as info:
        runpy.run_path(str(path), run_name="__main__")
    exc = info.value
    assert exc.__traceback__ is not None
    exc.__traceback__ = exc.__traceback__.tb_next  # as the worker sees it: runpy's frames on top
    return exc


def test_runners_are_ddpd_and_runpy() -> None:
    assert is_runner(os.path.join(os.path.dirname(ddpd.__file__), "worker", "bootstrap.py"))
    assert is_runner(str(runpy.__file__)) and is_runner("<frozen runpy>")
    assert not is_runner("/home/me/train.py") and not is_runner("/home/me/ddpd-train/ddpd.py")


def test_the_traceback_starts_at_the_scripts_frame(tmp_path: Path) -> None:
    exc = _raised_through_runpy(tmp_path)
    full = "".join(traceback.format_exception(exc))
    assert "runpy" in full
    text = user_traceback(exc)
    lines = text.split("direct cause of the following exception:")[1].strip().splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert lines[1].startswith(f'  File "{tmp_path / "train.py"}", line 7, in <module>'), text
    assert "runpy" not in text and "in load_batch" in text
    assert "KeyError: 'batch'" in text and "direct cause" in text  # the chained exception is kept
    assert text.rstrip().endswith("ValueError: bad batch")


def test_a_traceback_without_a_user_frame_is_kept_whole() -> None:
    try:
        runpy.run_path("/nonexistent/train.py")
    except OSError as exc:
        tb = exc.__traceback__
        assert tb is not None
        runner_only = tb.tb_next  # runpy's frames only
        assert user_frames(runner_only) is runner_only
    assert user_frames(None) is None
