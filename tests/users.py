"""Test users made for a module with useradd (as root) and removed afterwards; a directory they can reach;
this checkout opened to them for the block (CI clones where other users cannot traverse); a submit as
one of them. The fixtures over these (`users`, `plain_users`, `public_tmp`) are in tests/conftest.py."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import stat
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
import pytest

from ddpd.daemon.contain.identity import Identity
from ddpd.protocol import JobSpec

from .scripts.userpython import REPO, USER_PYTHON, user_pythonpath, why_unusable

if TYPE_CHECKING:  # conftest imports this module for its fixtures
    from .conftest import DaemonProc

SUBMIT_TIMEOUT = 120
# a user's submit through the Python client, the spec on stdin: the job id, or `refused <code>: <message>`
SUBMIT = r"""
import sys
import msgspec
from ddpd.client import Client, RemoteError
from ddpd.protocol import JobSpec
try:
    print(Client(sys.argv[1]).submit(msgspec.json.decode(sys.stdin.buffer.read(), type=JobSpec)), flush=True)
except RemoteError as exc:
    print("refused", exc, flush=True)
"""


def _useradd(name: str) -> Identity:
    subprocess.run(["useradd", "--system", "--no-create-home", "--home-dir", f"/home/{name}", "--shell", "/bin/sh",
                    name], check=True, capture_output=True)
    return Identity.of(int(subprocess.run(["id", "-u", name], check=True, capture_output=True).stdout))


@contextmanager
def two_users(prefix: str) -> Iterator[tuple[Identity, Identity]]:
    """Two new users named `<prefix>a<tag>` and `<prefix>b<tag>` (skips where useradd is missing)."""
    if shutil.which("useradd") is None or shutil.which("userdel") is None:
        pytest.skip("useradd/userdel are not available to create test users")
    tag = uuid.uuid4().hex[:6]
    made: list[str] = []
    try:
        ids = []
        for name in (f"{prefix}a{tag}", f"{prefix}b{tag}"):
            ids.append(_useradd(name))
            made.append(name)
        yield ids[0], ids[1]
    finally:
        for name in made:
            subprocess.run(["userdel", name], check=False, capture_output=True)


@contextmanager
def public_dir(prefix: str, mode: int) -> Iterator[Path]:
    """A short directory under /tmp every user can traverse (pytest's tmp_path is root's 0700)."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    path.chmod(mode)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


OPENED = Path(tempfile.gettempdir()) / "ddpd-tests-opened.json"  # the directories opened, and by whom


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextmanager
def _opened_state() -> Iterator[dict[str, Any]]:
    """The shared record of opened directories (modes to restore, the pids holding them open), read
    and written under an exclusive lock: the suite's xdist workers open and restore the same ones."""
    with open(OPENED.with_suffix(".lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            state: dict[str, Any] = json.loads(OPENED.read_text()) if OPENED.exists() else {}
        except ValueError:
            state = {}
        state.setdefault("modes", {})
        state["holders"] = [p for p in state.get("holders", []) if _alive(p)]  # a killed run's entries
        yield state
        OPENED.write_text(json.dumps(state))


@contextmanager
def opened_for_others(paths: list[str]) -> Iterator[None]:
    """Every directory above `paths` made traversable by others (o+x: not listable) while any test
    process of the run needs it, each restored to its exact mode when the last one is done: a
    checkout in a directory others cannot enter (CI's clone, a `mktemp -d`) still serves the test
    users its sources and the venv's packages. Bug: each worker restored what it had opened at the
    end of its own block, closing the checkout under another worker's test users mid-test."""
    me = os.getpid()
    with _opened_state() as state:
        for path in paths:
            for parent in [Path(path), *Path(path).parents]:
                st = parent.stat()
                if str(parent) not in state["modes"] and stat.S_ISDIR(st.st_mode) and not st.st_mode & stat.S_IXOTH:
                    state["modes"][str(parent)] = stat.S_IMODE(st.st_mode)
                    parent.chmod(stat.S_IMODE(st.st_mode) | stat.S_IXOTH)
        state["holders"].append(me)
    try:
        yield
    finally:
        with _opened_state() as state:
            if me in state["holders"]:
                state["holders"].remove(me)
            if not state["holders"]:
                for parent, mode in state["modes"].items():
                    with contextlib.suppress(FileNotFoundError):
                        os.chmod(parent, mode)
                state["modes"] = {}


@contextmanager
def user_python_for_tests() -> Iterator[None]:
    """USER_PYTHON with this checkout on its path, usable by the test users for the block; skips only
    where the machine has no such interpreter, fails where the checkout stays closed to them."""
    if not os.access(USER_PYTHON, os.X_OK):
        pytest.skip(f"{USER_PYTHON} (a python other users can run) is not installed")
    with opened_for_others([*user_pythonpath().split(os.pathsep), str(REPO)]):
        if (why := why_unusable()) is not None:
            pytest.fail(f"the test users cannot use this checkout: {why}")
        yield


def plain_env(**extra: str) -> dict[str, str]:
    """What a test user's own processes get: a plain PATH, this checkout on PYTHONPATH, HOME=/tmp."""
    return {"PATH": "/usr/bin:/bin", "PYTHONPATH": user_pythonpath(), "HOME": "/tmp", **extra}


async def submit_as(who: Identity, d: DaemonProc, spec: JobSpec) -> str:
    """`who` submits `spec` through the Python client, from a process of their own (USER_PYTHON, the
    spec on its stdin, so a large environment fits): the job id, or `refused <code>: <message>`."""
    with anyio.fail_after(SUBMIT_TIMEOUT):
        done = await anyio.run_process([USER_PYTHON, "-c", SUBMIT, str(d.socket)], input=msgspec.json.encode(spec),
                                       user=who.uid, group=who.gid, extra_groups=[], cwd="/", env=plain_env(),
                                       check=False)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    return done.stdout.decode().strip()
