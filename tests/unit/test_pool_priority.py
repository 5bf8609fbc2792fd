"""The warm pool's refill priority: its state in words, and a taken interpreter's threads back to
normal priority (a real process at SCHED_IDLE with a second thread)."""

from __future__ import annotations

import os
import resource
import subprocess
import sys

import pytest

from ddpd.daemon.pool.yielding import can_idle, pool_state, set_priority


@pytest.mark.parametrize(("args", "said"), [
    ((0, 0, 0, False, True), "off"),
    ((4, 2, 0, True, True), "warm (2 ready)"),
    ((4, 1, 1, True, True), "warm (1 ready, 1 refilling at idle priority)"),
    ((4, 0, 2, True, True), "cold (busy, 2 refilling at idle priority)"),
    ((4, 1, 2, True, True, 1), "warm (1 ready, 2 refilling at idle priority (1 held until a core is free))"),
    ((4, 0, 2, True, False, 2), "cold (busy, 2 refilling (2 held until a core is free))"),
    ((4, 0, 0, True, False), "cold (busy)"),
    ((4, 0, 2, False, True), "cold (refilling)"),
    ((4, 0, 0, False, True), "cold"),
])
def test_pool_state_says_why_it_is_cold(args: tuple[int, int, int, bool, bool] | tuple[int, int, int, bool, bool, int],
                                        said: str) -> None:
    assert pool_state(*args) == said


def test_a_root_daemon_may_move_refills_to_idle_priority_and_back() -> None:
    assert can_idle() is (os.geteuid() == 0 or resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20)


def test_every_thread_of_a_refill_moves_between_idle_and_normal_priority() -> None:
    """A refill runs at SCHED_IDLE beside a job, with threads of its own (its reader, torch's): all of
    them go back to normal priority once the job ends or a job takes it (or that rank would be
    starved by anything)."""
    code = ("import os, sys, threading\n"
            "threading.Thread(target=sys.stdin.read, daemon=True).start()\n"
            "print('ready', flush=True)\n"
            "sys.stdin.read()\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        tids = [int(t) for t in os.listdir(f"/proc/{proc.pid}/task")]
        assert len(tids) == 2
        assert {os.sched_getscheduler(t) for t in tids} == {os.SCHED_OTHER}
        set_priority(proc.pid, idle=True)
        assert {os.sched_getscheduler(t) for t in tids} == {os.SCHED_IDLE}
        set_priority(proc.pid, idle=False)
        assert {os.sched_getscheduler(t) for t in tids} == {os.SCHED_OTHER}
    finally:
        proc.kill()
        proc.wait(timeout=10)
    with pytest.raises(ProcessLookupError):
        os.kill(proc.pid, 0)
