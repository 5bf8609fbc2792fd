"""The reaper of inherited children: it reaps an orphan that came to this (subreaper) process, never
a child whose owner waits for it (registered at spawn), whose exit status the owner still gets."""

from __future__ import annotations

import ctypes
import os
import subprocess

from ddpd.daemon.contain.procs import PR_SET_CHILD_SUBREAPER, set_child_subreaper
from ddpd.daemon.contain.reaper import reap_inherited, spawned


def test_an_orphan_is_reaped_and_a_registered_child_keeps_its_status() -> None:
    """Bug: a job's 200 orphaned grandchildren stayed zombies of the daemon after it ended."""
    assert set_child_subreaper()  # as the daemon is: orphans below this process come to it
    try:
        mine = spawned(lambda: subprocess.Popen(["sh", "-c", "exit 3"], start_new_session=True))
        shell = subprocess.Popen(["sh", "-c", "sleep 0 & echo $!"], stdout=subprocess.PIPE, start_new_session=True)
        out, _ = shell.communicate(timeout=30)  # the shell is reaped by its owner; its `sleep` is orphaned to us
        orphan = int(out)
        for pid in (mine.pid, orphan):
            os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: a zombie each
        reaped = reap_inherited()
    finally:  # this test process is the suite's, not a daemon
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
    assert orphan in reaped and mine.pid not in reaped
    assert mine.wait(timeout=10) == 3  # its owner gets the real status
