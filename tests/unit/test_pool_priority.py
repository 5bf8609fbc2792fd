"""The warm pool's refill priority: its state in words, and a taken interpreter's threads back to
normal priority (a real process at SCHED_IDLE with a second thread)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ddpd.daemon.pool.pool import normal_priority, pool_state
from ddpd.protocol.worker import pool_idle_priority


@pytest.mark.parametrize(("args", "said"), [
    ((0, 0, 0, False, True), "off"),
    ((4, 2, 0, True, True), "warm (2 ready)"),
    ((4, 1, 1, True, True), "warm (1 ready, 1 refilling at idle priority)"),
    ((4, 0, 2, True, True), "cold (busy, 2 refilling at idle priority)"),
    ((4, 0, 0, True, False), "cold (busy)"),
    ((4, 0, 2, False, True), "cold (refilling)"),
    ((4, 0, 0, False, True), "cold"),
])
def test_pool_state_says_why_it_is_cold(args: tuple[int, int, int, bool, bool], said: str) -> None:
    assert pool_state(*args) == said


def test_a_root_daemon_refills_at_idle_priority() -> None:
    assert pool_idle_priority(0)


def test_every_thread_of_a_taken_interpreter_gets_normal_priority_back() -> None:
    """A pool interpreter waits at SCHED_IDLE with threads of its own (its reader, torch's): all of them
    must run at normal priority once a job takes it, or the job's rank would be starved by anything."""
    code = ("import os, sys, threading\n"
            "os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\n"
            "threading.Thread(target=sys.stdin.read, daemon=True).start()\n"
            "print('ready', flush=True)\n"
            "sys.stdin.read()\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        tids = [int(t) for t in os.listdir(f"/proc/{proc.pid}/task")]
        assert len(tids) == 2
        assert {os.sched_getscheduler(t) for t in tids} == {os.SCHED_IDLE}
        normal_priority(proc.pid)
        assert {os.sched_getscheduler(t) for t in tids} == {os.SCHED_OTHER}
    finally:
        proc.kill()
        proc.wait(timeout=10)
    with pytest.raises(ProcessLookupError):
        os.kill(proc.pid, 0)
