"""A submit's paths are looked at as the submitter, in a bounded helper (issue 34, finding 7)."""

from __future__ import annotations

import os
import pwd
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddpd.daemon.contain import pathcheck
from ddpd.daemon.contain.identity import Identity
from ddpd.daemon.contain.pathcheck import PathProblem, check_paths_as


def _nobody() -> Identity:
    if os.geteuid() != 0:
        pytest.skip("only root can look as another user")
    try:
        return Identity.of(pwd.getpwnam("nobody").pw_uid)
    except KeyError:
        pytest.skip("no user `nobody` here")


@pytest.fixture
def open_tmp() -> Iterator[Path]:
    """A directory under /tmp others may enter (pytest's tmp_path sits in root's 0700 one)."""
    path = Path(tempfile.mkdtemp(prefix="ddpd-pc", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_what_a_user_cannot_reach_reads_the_same_whether_it_exists_or_not(open_tmp: Path) -> None:
    who = _nobody()
    tmp_path = open_tmp
    closed = tmp_path / "closed"
    closed.mkdir(mode=0o700)
    (closed / "there.py").write_text("print('secret')\n")
    there = check_paths_as(who, "/", str(closed / "there.py"), 10)
    missing = check_paths_as(who, "/", str(closed / "missing.py"), 10)
    assert there is not None and missing is not None
    assert there.message.replace("there.py", "X") == missing.message.replace("missing.py", "X")
    assert "permission denied to user nobody" in there.message and there.field == "script"
    wd = check_paths_as(who, str(closed), None, 10)
    assert wd is not None and wd.field == "workdir" and "permission denied" in wd.message
    root = Identity.of(0)  # root sees what is there
    assert check_paths_as(root, "/", str(closed / "there.py"), 10) is None
    assert check_paths_as(root, "/", str(closed / "missing.py"), 10) == PathProblem(
        "script", f"{closed / 'missing.py'} does not exist")


def test_the_users_own_view_and_relative_scripts(open_tmp: Path) -> None:
    who = _nobody()
    tmp_path = open_tmp
    (tmp_path / "train.py").write_text("pass\n")
    (tmp_path / "train.py").chmod(0o644)
    (tmp_path / "private.py").write_text("pass\n")
    (tmp_path / "private.py").chmod(0o600)
    assert check_paths_as(who, str(tmp_path), "train.py", 10) is None
    assert check_paths_as(who, str(tmp_path), str(tmp_path / "train.py"), 10) is None
    assert check_paths_as(who, str(tmp_path), "nope.py", 10) == PathProblem(
        "script", f"{tmp_path}/nope.py does not exist")
    private = check_paths_as(who, str(tmp_path), "private.py", 10)
    assert private is not None and "permission denied" in private.message  # it can stat it: it sees it is there
    assert check_paths_as(who, str(tmp_path), str(tmp_path), 10) == PathProblem(
        "script", f"{tmp_path} is not a regular file")
    assert check_paths_as(who, str(tmp_path / "train.py"), None, 10) == PathProblem(
        "workdir", f"{tmp_path / 'train.py'} is not a directory")


def test_a_helper_that_does_not_answer_is_killed_within_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    who = _nobody()
    marker = f"ddpd-pathcheck-{os.getpid()}"
    monkeypatch.setattr(pathcheck, "HELPER", f"import sys, time; sys.stdin.read(); {marker!r}; time.sleep(600)")
    started = time.monotonic()
    problem = check_paths_as(who, "/", None, 0.5)
    assert time.monotonic() - started < 0.5 + pathcheck.KILL_WAIT + 1
    assert problem is not None and problem.field == "workdir"
    assert "could not be checked as user nobody" in problem.message and "within 0.5 s" in problem.message
    for name in os.listdir("/proc"):  # nothing of it left
        if name.isdigit():
            try:
                assert marker.encode() not in Path(f"/proc/{name}/cmdline").read_bytes()
            except OSError:
                continue
