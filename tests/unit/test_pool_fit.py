"""Which jobs a warm-pool interpreter may serve: the pool's interpreter, and the same values of every
variable read at interpreter or torch start (the rest of the job's environment is applied on assignment)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ddpd.daemon.launch import pool_fits, same_interpreter

POOL = {"PATH": "/usr/bin", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "LANG": "C.UTF-8", "HOME": "/root"}


def test_a_client_that_sends_nothing_fits() -> None:
    assert pool_fits(None, None, POOL, sys.executable)


def test_the_submitters_environment_fits_when_start_variables_agree() -> None:
    environ = {"PATH": "/usr/bin:/opt/bin", "LANG": "C.UTF-8", "MY_SETTING": "hello", "OMP_NUM_THREADS": "4"}
    assert pool_fits(sys.executable, environ, POOL, sys.executable)  # PATH, MY_SETTING, OMP: applied on Assign


def test_a_variable_read_at_start_that_differs_does_not_fit() -> None:
    assert not pool_fits(None, {"LANG": "C.UTF-8", "PYTHONPATH": "/mine"}, POOL, sys.executable)
    assert not pool_fits(None, {"LANG": "de_DE.UTF-8"}, POOL, sys.executable)
    assert not pool_fits(None, {}, POOL, sys.executable)  # LANG missing: torch would start differently


def test_another_interpreter_or_venv_does_not_fit(tmp_path: Path) -> None:
    venv_bin = tmp_path / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "python").symlink_to(os.path.realpath(sys.executable))  # a venv over the same base interpreter
    assert not same_interpreter(str(venv_bin / "python"), sys.executable)
    assert not pool_fits(str(venv_bin / "python"), None, POOL, sys.executable)
    assert same_interpreter(sys.executable, sys.executable)
