"""The leftover sweep reaps only the pids it is given (real child processes, no worker)."""

from __future__ import annotations

import os
import subprocess

from ddpd.daemon.contain.procs import reap_children


def _exited(proc: subprocess.Popen[bytes]) -> None:
    """Block until `proc` has exited, leaving it a zombie (WNOWAIT: not reaped)."""
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)


def test_reaping_leaves_other_owners_zombies_alone() -> None:
    """Bug: one attempt's sweep reaped every zombie child of the daemon; the real owner's wait then got
    ECHILD and CPython recorded exit code 0, so a crashed rank could end its job SUCCEEDED."""
    theirs = subprocess.Popen(["sh", "-c", "exit 3"])
    mine = subprocess.Popen(["sh", "-c", "exit 0"])
    _exited(theirs)
    _exited(mine)
    assert reap_children({mine.pid, 999_999_999}) == [mine.pid]  # not ours, or gone: skipped
    assert theirs.wait(timeout=10) == 3  # its owner still gets the real exit status
    assert reap_children({theirs.pid}) == []
