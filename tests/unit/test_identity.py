"""The submitter's identity: passwd lookups, Popen kwargs, who a daemon serves, the rank environment."""

from __future__ import annotations

import os
import pwd
import time
from pathlib import Path

import pytest

from ddpd.daemon.contain.identity import (
    RANK_UMASK,
    Identity,
    UnknownUser,
    check_serves,
    job_environment,
    may_see_detail,
    popen_kwargs,
)
from ddpd.daemon.control.interpreters import check_interpreter


def test_identity_of_root_comes_from_passwd() -> None:
    root = Identity.of(0)
    entry = pwd.getpwuid(0)
    assert (root.uid, root.gid, root.name, root.home) == (0, entry.pw_gid, entry.pw_name, entry.pw_dir)
    assert entry.pw_gid in root.groups
    assert root.identity_env() == {"HOME": entry.pw_dir, "USER": "root", "LOGNAME": "root", "SHELL": root.shell}


def test_unknown_uid_is_refused_by_name() -> None:
    with pytest.raises(UnknownUser, match="uid 4000000000 has no passwd entry"):
        Identity.of(4_000_000_000)


def test_popen_kwargs_switch_user_only_for_a_root_daemon() -> None:
    who = Identity(uid=1234, gid=2345, groups=(2345, 27), name="ann", home="/home/ann", shell="/bin/bash")
    assert popen_kwargs(who, daemon_uid=0) == {
        "user": 1234, "group": 2345, "extra_groups": [2345, 27], "umask": RANK_UMASK,
    }
    assert popen_kwargs(who, daemon_uid=1234) == {}
    assert RANK_UMASK == 0o077


@pytest.mark.parametrize(
    ("daemon", "peer", "allow_root", "refused"),
    [
        (0, 1000, False, None),
        (0, 0, False, "jobs of root (uid 0) are refused"),
        (0, 0, True, None),
        (1000, 1000, False, None),
        (1000, 1001, False, "serves that user only"),
        (1000, 0, True, "serves that user only"),
    ],
)
def test_check_serves(daemon: int, peer: int, allow_root: bool, refused: str | None) -> None:
    reason = check_serves(daemon, peer, allow_root)
    if refused is None:
        assert reason is None
    else:
        assert reason is not None and refused in reason


def test_job_environment_layers_identity_extra_and_reserved() -> None:
    who = Identity(uid=1234, gid=2345, groups=(2345,), name="ann", home="/home/ann", shell="/bin/zsh")
    env = job_environment(
        who,
        exported={"HOME": "/tmp/spoofed", "USER": "root", "MY_SETTING": "hello", "DDPD_JOB_ID": "x"},
        extra={"MY_SETTING": "override", "OTHER": "1"},
        reserved={"DDPD_JOB_ID": "j-1"},
    )
    assert env == {
        "HOME": "/home/ann", "USER": "ann", "LOGNAME": "ann", "SHELL": "/bin/zsh",
        "MY_SETTING": "override", "OTHER": "1", "DDPD_JOB_ID": "j-1",
    }


def test_check_interpreter_needs_an_absolute_path() -> None:
    reason = check_interpreter(Identity.of(os.getuid()), "python3", {}, timeout=5)
    assert reason is not None and "must be an absolute path" in reason


def test_check_interpreter_names_a_missing_file() -> None:
    reason = check_interpreter(Identity.of(os.getuid()), "/nonexistent/bin/python", {}, timeout=5)
    assert reason is not None and "does not exist" in reason


def test_detail_is_for_the_owner_root_and_the_admin_group() -> None:
    ann = Identity(uid=1000, gid=1000, groups=(1000, 50), name="ann", home="/h/ann", shell="/bin/sh")
    bob = Identity(uid=1001, gid=1001, groups=(1001,), name="bob", home="/h/bob", shell="/bin/sh")
    root = Identity(uid=0, gid=0, groups=(0,), name="root", home="/root", shell="/bin/sh")
    assert may_see_detail(ann, owner_uid=1000, admin=None)
    assert not may_see_detail(bob, owner_uid=1000, admin=None)
    assert may_see_detail(root, owner_uid=1000, admin=None)
    assert may_see_detail(ann, owner_uid=1001, admin=50)
    assert not may_see_detail(bob, owner_uid=1000, admin=50)


def _fake_python(tmp_path: Path, body: str) -> str:
    path = tmp_path / "python"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return str(path)


def test_check_interpreter_is_bounded_in_time(tmp_path: Path) -> None:
    python = _fake_python(tmp_path, "exec sleep 60")
    started = time.monotonic()
    reason = check_interpreter(Identity.of(os.getuid()), python, {"PATH": "/usr/bin:/bin"}, timeout=0.5)
    assert reason is not None and "did not finish `import torch, ddpd.worker` within 0.5 s" in reason
    assert time.monotonic() - started < 10


def test_check_interpreter_keeps_only_the_tail_of_endless_output(tmp_path: Path) -> None:
    python = _fake_python(tmp_path, "exec yes 'ModuleNotFoundError: No module named '\"'\"'x'\"'\"'' >&2")
    reason = check_interpreter(Identity.of(os.getuid()), python, {"PATH": "/usr/bin:/bin"}, timeout=0.5)
    assert reason is not None and "within 0.5 s" in reason


def test_check_interpreter_names_the_missing_module(tmp_path: Path) -> None:
    python = _fake_python(tmp_path, "echo \"ModuleNotFoundError: No module named 'ddpd'\" >&2; exit 1")
    reason = check_interpreter(Identity.of(os.getuid()), python, {"PATH": "/usr/bin:/bin"}, timeout=10)
    assert reason is not None
    assert "cannot import ddpd" in reason and "pip install ddpd" in reason


def test_check_interpreter_reports_another_failure_by_its_last_line(tmp_path: Path) -> None:
    python = _fake_python(tmp_path, "echo 'ImportError: libcuda.so.1: cannot open shared object file' >&2; exit 1")
    reason = check_interpreter(Identity.of(os.getuid()), python, {"PATH": "/usr/bin:/bin"}, timeout=10)
    assert reason is not None and reason.endswith("ImportError: libcuda.so.1: cannot open shared object file")
