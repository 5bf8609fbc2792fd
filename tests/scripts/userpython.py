"""An interpreter other users can run that imports torch and ddpd, for tests that submit as them.

The test suite's own interpreter may live where other users cannot reach (a venv whose python
links into root's 0700 home). The system's python of the same version, with this checkout's
sources and the venv's site-packages on PYTHONPATH (both world-readable here), imports what a
rank needs: that is what a user would export in their shell.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
USER_PYTHON = f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"


def user_pythonpath() -> str:
    return os.pathsep.join([str(REPO / "src"), str(REPO), sysconfig.get_paths()["purelib"]])


def user_env(**extra: str) -> dict[str, str]:
    """A submitting shell's environment: this process's, with the PYTHONPATH above."""
    return {**os.environ, "PYTHONPATH": user_pythonpath(), **extra}


def why_unusable() -> str | None:
    """Why USER_PYTHON cannot serve here, or None (tests.integration.users.user_python_for_tests opens
    the checkout to other users first)."""
    if not os.access(USER_PYTHON, os.X_OK):
        return f"{USER_PYTHON} (a python other users can run) is not installed"
    for path in user_pythonpath().split(os.pathsep):
        p = Path(path)
        while p != p.parent:
            if not os.stat(p).st_mode & 0o001:
                return f"{p} is not traversable by other users; no interpreter for them has torch and ddpd"
            p = p.parent
    for module in (REPO / "src" / "ddpd" / "__init__.py", Path(sysconfig.get_paths()["purelib"]) / "torch"):
        if module.exists() and not os.stat(module).st_mode & 0o004:
            return f"{module} is not readable by other users (a checkout made under umask 077?)"
    return None
