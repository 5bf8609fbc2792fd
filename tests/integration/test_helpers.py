"""The helper-process service with real processes and cgroups: a bounded run keeps only the tails of
what the helper writes and returns at its exit even while a child of its holds the pipes open; its
group is killed; one past its bound is cut off; a contained run ends its cgroup, and with it a
`setsid` escapee; a kind's sweep ends its own leftover cgroups and no other's.
"""

from __future__ import annotations

import os
import select
import subprocess
import time
from pathlib import Path

import anyio
import pytest

from ddpd.daemon.contain.cgroups import Cgroup, Subtree
from ddpd.daemon.contain.helpers import HelperKind, Place, run_bounded, run_contained
from ddpd.daemon.contain.identity import Identity
from ddpd.daemon.control.interpreters import CHECKS
from ddpd.daemon.multinode.agentproc import AGENTS
from tests.conftest import assert_gone

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="cgroups and the gate need root")

BOUND = 30.0
ENV = {"PATH": "/usr/bin:/bin"}


def _reaped_and_gone(pidfile: Path) -> None:
    """The helper's child (reparented to this subreaper once its helper exited) exits within the bound."""
    pid = int(pidfile.read_text())
    fd = os.pidfd_open(pid)
    try:
        assert select.select([fd], [], [], BOUND)[0], f"process {pid} is still running"
    finally:
        os.close(fd)
    os.waitpid(pid, 0)
    assert_gone(pid)


def test_a_bounded_run_keeps_the_tails_and_returns_at_the_exit(tmp_path: Path, subreaper: None) -> None:
    """A helper that writes 4 MiB to each pipe (16 times what a pipe holds) and leaves a child holding
    both: its exit status and the tails come back at its exit, not at the bound; the child dies with
    the group."""
    pidfile = tmp_path / "child.pid"
    script = (f"head -c 4194304 /dev/zero | tr '\\0' o; head -c 4194304 /dev/zero | tr '\\0' e >&2; "
              f"sleep 60 & echo $! > {pidfile}; echo out-end; echo err-end >&2; exit 3")
    started = time.monotonic()
    ran = run_bounded(["/bin/sh", "-c", script], ENV, Identity.of(0), BOUND, None, what="a test helper",
                      stdout_keep=16, stderr_keep=64)
    assert time.monotonic() - started < BOUND / 2
    assert ran.returncode == 3
    assert ran.stdout == b"o" * 8 + b"out-end\n"
    assert len(ran.stderr) == 64 and ran.stderr.endswith(b"e" * 16 + b"err-end\n")
    _reaped_and_gone(pidfile)


def test_a_bounded_run_past_its_bound_is_cut_off(tmp_path: Path, subreaper: None) -> None:
    pidfile = tmp_path / "child.pid"
    started = time.monotonic()
    ran = run_bounded(["/bin/sh", "-c", f"sleep 60 & echo $! > {pidfile}; wait"], ENV, Identity.of(0), 0.5, None,
                      what="a test helper")
    assert ran.returncode is None and time.monotonic() - started < BOUND / 2
    _reaped_and_gone(pidfile)


def test_a_contained_run_ends_its_cgroup_and_a_setsid_escapee(
    cgroup_base: Path, tmp_path: Path, subreaper: None
) -> None:
    """`setsid` leaves the helper's group: only the end of its cgroup can kill what it started."""
    kind = HelperKind("test_helper", prefix="helper-", kill_wait=BOUND)
    subtree = Subtree(cgroup_base, cgroup_base, frozenset())
    pidfile = tmp_path / "escapee.pid"
    script = f"setsid sleep 60 < /dev/null > /dev/null 2>&1 & echo $! > {pidfile}; exit 0"
    seen: list[list[str]] = []

    def run(place: Place | None) -> int | None:
        seen.append(sorted(p.name for p in cgroup_base.iterdir() if p.is_dir()))
        assert place is not None
        return run_bounded(["/bin/sh", "-c", script], ENV, Identity.of(0), BOUND, place,
                           what="a test helper").returncode

    async def main() -> int | None:
        with anyio.fail_after(BOUND):
            return await run_contained(kind, subtree, "7", run, uid=0)

    assert anyio.run(main) == 0
    assert seen == [["helper-7"]]  # it ran in a cgroup of its own
    assert not (cgroup_base / "helper-7").exists()
    _reaped_and_gone(pidfile)


def test_a_kinds_sweep_ends_its_own_leftovers_and_no_others(cgroup_base: Path) -> None:
    names = ["check-1000-1", "check-1000-2", "notify-1000-1", "j-1-a1", "j-1-rdzv", "pool-1"]
    procs = {}
    for name in names:
        cg = Cgroup.create(cgroup_base, name)
        procs[name] = subprocess.Popen(["sleep", "60"])
        cg.add(procs[name].pid)
    try:
        assert CHECKS.sweep(cgroup_base) == 2
        assert AGENTS.sweep(cgroup_base) == 1
        left = sorted(p.name for p in cgroup_base.iterdir() if p.is_dir())
        assert left == ["j-1-a1", "notify-1000-1", "pool-1"]
        for name in ["check-1000-1", "check-1000-2", "j-1-rdzv"]:
            assert procs[name].wait(BOUND) == -9  # killed by its cgroup's end
        assert all(procs[name].poll() is None for name in left)
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait(BOUND)
            assert_gone(proc.pid)
