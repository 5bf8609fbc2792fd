"""Test users made for a module with useradd (as root) and removed afterwards; a directory they can reach;
this checkout opened to them for the block (CI clones where other users cannot traverse)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from ddpd.daemon.contain.identity import Identity

from ..scripts.userpython import REPO, USER_PYTHON, user_pythonpath, why_unusable


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


@contextmanager
def opened_for_others(paths: list[str]) -> Iterator[None]:
    """Every directory above `paths` made traversable by others (o+x: not listable) for the block,
    each restored to its exact mode afterwards: a checkout in a home directory others cannot enter
    (CI's clone) still serves the test users its sources and the venv's packages."""
    changed: dict[Path, int] = {}
    try:
        for path in paths:
            for parent in [Path(path), *Path(path).parents]:
                st = parent.stat()
                if parent not in changed and stat.S_ISDIR(st.st_mode) and not st.st_mode & stat.S_IXOTH:
                    changed[parent] = stat.S_IMODE(st.st_mode)
                    parent.chmod(changed[parent] | stat.S_IXOTH)
        yield
    finally:
        for parent, mode in changed.items():
            parent.chmod(mode)


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
