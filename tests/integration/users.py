"""Test users made for a module with useradd (as root) and removed afterwards; a directory they can reach."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from ddpd.daemon.contain.identity import Identity


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
