"""Identity and containment with real processes, as root, with two users created for the test.

A process started with `popen_kwargs` or through the gate runs with the user's uid, groups and
HOME; the user tree is the user's and closed to the other user; `check_interpreter` refuses what
the user cannot run or import; a setsid, double-forked escapee is ended by `cgroup.kill`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ddpd.daemon.contain.cgroups import Cgroup, own_cgroup, parse_mountinfo, prepare_subtree
from ddpd.daemon.contain.gate import spawn_gated
from ddpd.daemon.contain.identity import Identity, popen_kwargs
from ddpd.daemon.contain.usertree import create_user_file, ensure_base, ensure_job_dir
from ddpd.daemon.control.interpreters import check_interpreter
from tests.conftest import assert_gone

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="acting as other users needs root"),
    pytest.mark.xdist_group("users"),  # useradd/userdel lock /etc/passwd: one worker at a time
    pytest.mark.public_tmp(0o711),  # traversable, not listable
]

PROC_TIMEOUT = 30
SYSTEM_PYTHON = "/usr/bin/python3.11"
VENV_PYTHON = sys.executable  # the suite's own interpreter (a venv under /root, mode 0700, on CI)




def _status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: v.strip() for k, _, v in (line.partition(":") for line in lines)}


def _environ(pid: int) -> dict[str, str]:
    items = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().partition("=")[::2] for item in items if item)


def _assert_runs_as(pid: int, who: Identity) -> None:
    status = _status(pid)
    assert status["Uid"].split() == [str(who.uid)] * 4
    assert status["Gid"].split() == [str(who.gid)] * 4
    assert sorted(int(g) for g in status["Groups"].split()) == sorted(who.groups)
    assert int(status["Umask"], 8) == 0o077


def _end(proc: subprocess.Popen[bytes]) -> None:
    proc.kill()
    proc.wait(PROC_TIMEOUT)
    assert_gone(proc.pid)


def test_popen_kwargs_run_a_process_as_the_user(plain_users: tuple[Identity, Identity]) -> None:
    ann, _ = plain_users
    env = {**ann.identity_env(), "PATH": "/usr/bin:/bin"}
    proc = subprocess.Popen(["/bin/sleep", "60"], env=env, cwd="/", **popen_kwargs(ann))
    try:
        _assert_runs_as(proc.pid, ann)
        seen = _environ(proc.pid)
        assert (seen["HOME"], seen["USER"], seen["LOGNAME"]) == (ann.home, ann.name, ann.name)
    finally:
        _end(proc)


def test_the_user_tree_is_the_users_and_closed_to_another(
    plain_users: tuple[Identity, Identity], public_tmp: Path
) -> None:
    ann, bob = plain_users
    state = public_tmp / "state"
    ensure_base(state)
    (state / "ddpd.db").write_bytes(b"daemon's own\n")
    (state / "ddpd.db").chmod(0o600)
    path = ensure_job_dir(state, ann, "j-1")
    fd = create_user_file(state, ann, "jobs", "j-1", name="rank-0.log")
    os.write(fd, b"ann's secret\n")
    os.close(fd)
    log = path / "rank-0.log"
    assert (log.stat().st_uid, path.stat().st_uid) == (ann.uid, ann.uid)

    def cat(who: Identity, target: Path) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(["/bin/cat", str(target)], capture_output=True, cwd="/", timeout=PROC_TIMEOUT,
                              check=False, **popen_kwargs(who))

    assert cat(ann, log).stdout == b"ann's secret\n"
    refused = cat(bob, log)
    assert refused.returncode != 0 and b"Permission denied" in refused.stderr
    for who in (ann, bob):
        assert b"Permission denied" in cat(who, state / "ddpd.db").stderr
    listing = subprocess.run(["/bin/ls", str(state / "users")], capture_output=True, cwd="/",
                             timeout=PROC_TIMEOUT, check=False, **popen_kwargs(bob))
    assert b"Permission denied" in listing.stderr


def test_check_interpreter_refuses_a_python_the_user_cannot_reach(
    plain_users: tuple[Identity, Identity], public_tmp: Path
) -> None:
    ann, _ = plain_users
    closed = public_tmp / "closed"
    closed.mkdir(mode=0o700)
    shutil.copy2(SYSTEM_PYTHON, closed / "python3")
    reason = check_interpreter(ann, str(closed / "python3"), {"PATH": "/usr/bin:/bin"}, timeout=PROC_TIMEOUT)
    assert reason is not None
    assert f"is not executable by user {ann.name} (uid {ann.uid})" in reason


def test_check_interpreter_refuses_the_daemons_venv_behind_roots_home(plain_users: tuple[Identity, Identity]) -> None:
    ann, _ = plain_users
    target = Path(VENV_PYTHON).resolve()
    if not Path(VENV_PYTHON).exists() or not any(
        (p.stat().st_mode & 0o001) == 0 for p in target.parents if p != Path("/")
    ):
        pytest.skip(f"{VENV_PYTHON} ({target}) is reachable by every user here")
    reason = check_interpreter(ann, VENV_PYTHON, {"PATH": "/usr/bin:/bin"}, timeout=PROC_TIMEOUT)
    assert reason is not None and "is not executable by user" in reason


def test_check_interpreter_names_the_module_the_user_lacks(plain_users: tuple[Identity, Identity]) -> None:
    ann, _ = plain_users
    if subprocess.run([SYSTEM_PYTHON, "-c", "import torch, ddpd.worker"], capture_output=True,
                      env={"PATH": "/usr/bin:/bin"}, check=False).returncode == 0:
        pytest.skip(f"{SYSTEM_PYTHON} has torch and ddpd here")
    reason = check_interpreter(ann, SYSTEM_PYTHON, {"PATH": "/usr/bin:/bin"}, timeout=PROC_TIMEOUT)
    assert reason is not None
    assert f"cannot import torch as user {ann.name}" in reason or f"cannot import ddpd as user {ann.name}" in reason
    assert "No module named" in reason and "pip install" in reason


def test_check_interpreter_accepts_the_daemons_own_python_for_root() -> None:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    assert check_interpreter(Identity.of(0), sys.executable, env, timeout=120) is None


def test_gate_places_the_rank_before_it_runs_then_drops_to_the_user(
    plain_users: tuple[Identity, Identity], cgroup_base: Path, public_tmp: Path
) -> None:
    ann, _ = plain_users
    state = public_tmp / "state"
    ensure_base(state)
    workdir = ensure_job_dir(state, ann, "j-1")
    cg = Cgroup.create(cgroup_base, "j-1-a1")
    script = 'pwd; echo "$HOME $MY_SETTING"; grep ^0:: /proc/self/cgroup; echo ready; exec /bin/sleep 60'
    env = {**ann.identity_env(), "PATH": "/usr/bin:/bin", "MY_SETTING": "hello"}
    proc = spawn_gated(["/bin/sh", "-c", script], env, str(workdir), ann, cg.add,
                       stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, process_group=0)
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline().decode().strip() for _ in range(2)]
        cgroup_line = proc.stdout.readline().decode().strip()
        assert proc.stdout.readline() == b"ready\n"  # a builtin, after grep was waited for
        assert lines == [str(workdir), f"{ann.home} hello"]
        assert cgroup_line.startswith("0::/") and cgroup_line.endswith(f"/{cgroup_base.name}/j-1-a1")
        assert own_cgroup(proc.pid) == cg.path
        assert cg.pids() == [proc.pid]
        _assert_runs_as(proc.pid, ann)
        assert os.getpgid(proc.pid) == proc.pid
    finally:
        assert cg.kill(PROC_TIMEOUT)
        proc.wait(PROC_TIMEOUT)
        assert_gone(proc.pid)
        cg.remove()


def test_gate_runs_nothing_when_placement_fails(cgroup_base: Path, public_tmp: Path) -> None:
    marker = public_tmp / "ran"

    def refuse(pid: int) -> None:
        raise OSError(1, "placement refused")

    with pytest.raises(OSError, match="placement refused"):
        spawn_gated(["/bin/sh", "-c", f"touch {marker}"], {}, "/", None, refuse)
    assert not marker.exists()


ESCAPE = r"""
import os, time
r, w = os.pipe()
mid = os.fork()
if mid == 0:
    os.setsid()
    if os.fork() == 0:
        os.write(w, f"{os.getpid()} {os.getsid(0)}".encode())
        time.sleep(600)
    os._exit(0)
os.close(w)
os.waitpid(mid, 0)
escapee = os.read(r, 100).decode()
os.write(1, f"{escapee} {mid}\n".encode())
time.sleep(600)
"""


def test_cgroup_kill_ends_a_setsid_double_forked_escapee(
    plain_users: tuple[Identity, Identity], cgroup_base: Path, subreaper: None
) -> None:
    ann, _ = plain_users
    subtree = prepare_subtree(cgroup_base, "test")
    cg = Cgroup.create(subtree.jobs, "j-2-a1")
    proc = spawn_gated([SYSTEM_PYTHON, "-c", ESCAPE], {"PATH": "/usr/bin:/bin"}, "/", ann, cg.add,
                       stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, process_group=0)
    assert proc.stdout is not None
    escapee, sid, mid = (int(x) for x in proc.stdout.readline().split())
    assert sid == mid != os.getsid(proc.pid)  # it left the rank's session and process group
    assert os.getpgid(escapee) != os.getpgid(proc.pid)
    assert sorted(cg.pids()) == sorted([proc.pid, escapee])
    _assert_runs_as(escapee, ann)
    assert cg.kill(PROC_TIMEOUT)
    assert not cg.populated()
    proc.wait(PROC_TIMEOUT)
    os.waitpid(escapee, 0)  # reparented to this subreaper when its parent exited
    for pid in (proc.pid, mid, escapee):
        assert_gone(pid)
    cg.remove()
    assert not cg.path.exists()


def test_prepare_subtree_moves_residents_out_and_reports_controllers(cgroup_base: Path) -> None:
    resident = subprocess.Popen(["/bin/sleep", "60"], stdin=subprocess.DEVNULL)
    try:
        Cgroup(cgroup_base).add(resident.pid)
        subtree = prepare_subtree(cgroup_base, "test")
        assert subtree.jobs == cgroup_base / "jobs"
        assert Cgroup(cgroup_base).pids() == []
        assert Cgroup(cgroup_base / "daemon").pids() == [resident.pid]
        assert own_cgroup(resident.pid) == cgroup_base / "daemon"
        assert prepare_subtree(cgroup_base, "test") == subtree  # a restarted daemon finds it done
        cg = Cgroup.create(subtree.jobs, "j-3-a1")
        report = cg.set_limits(memory_bytes=1 << 30, cpus=1.5)
        wanted = (("memory", "memory.max", str(1 << 30)), ("cpu", "cpu.max", "150000 100000"))
        for controller, filename, value in wanted:
            if controller in subtree.controllers:
                assert report.applied[filename] == value
                assert (cg.path / filename).read_text().strip() == value
            else:
                assert "not delegated" in report.unavailable[controller]
                assert "not delegated" in subtree.unavailable[controller]
    finally:
        _end(resident)


def test_wait_empty_wakes_on_the_event_not_the_timeout(cgroup_base: Path) -> None:
    cg = Cgroup.create(cgroup_base, "j-4-a1")
    sleeper = subprocess.Popen(["/bin/sleep", "60"], stdin=subprocess.DEVNULL)
    try:
        cg.add(sleeper.pid)
        assert cg.populated()
        assert not cg.wait_empty(0.05)  # bounded: a live cgroup is reported, not waited on forever
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(cg.wait_empty, 120)
            started = time.monotonic()
            sleeper.kill()
            assert waiting.result(timeout=PROC_TIMEOUT)
            assert time.monotonic() - started < PROC_TIMEOUT
    finally:
        _end(sleeper)
    cg.remove()


def test_an_attempt_takes_over_a_pooled_workers_cgroup(cgroup_base: Path, subreaper: None) -> None:
    pooled = Cgroup.create(cgroup_base, "pool-1")
    attempt = Cgroup.create(cgroup_base, "j-5-a1")
    rank = Cgroup.create(attempt.path, "rank-0")
    proc = spawn_gated(["/bin/sh", "-c", "/bin/sleep 60 & echo $!; exec /bin/sleep 60"], {}, "/", None, pooled.add,
                       stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, process_group=0)
    assert proc.stdout is not None
    child = int(proc.stdout.readline())
    assert sorted(pooled.pids()) == sorted([proc.pid, child])
    assert rank.take_over(pooled, PROC_TIMEOUT)
    assert not pooled.path.exists()
    assert sorted(rank.pids()) == sorted([proc.pid, child])
    assert attempt.populated()  # populated counts the rank leaves below
    assert attempt.kill(PROC_TIMEOUT)
    proc.wait(PROC_TIMEOUT)
    attempt.remove()
    assert not attempt.path.exists()
    os.waitpid(child, 0)  # reparented to this subreaper when its parent died
    for pid in (proc.pid, child):
        assert_gone(pid)


def test_prepare_subtree_at_the_root_moves_nobody(cgroup_base: Path) -> None:
    root = parse_mountinfo(Path("/proc/self/mountinfo").read_text())
    assert root is not None
    before = own_cgroup()
    instance = f"test-{uuid.uuid4().hex[:8]}"
    subtree = prepare_subtree(root, instance)
    try:
        assert subtree.jobs == root / f"ddpd-{instance}"
        assert own_cgroup() == before  # the root holds the whole machine: nothing was moved
        assert not (root / "daemon").exists()
        assert set(subtree.controllers) | set(subtree.unavailable) == {"memory", "cpu", "pids"}
    finally:
        Cgroup(subtree.jobs).remove()


def test_gate_enters_the_working_directory_as_the_user(
    plain_users: tuple[Identity, Identity], cgroup_base: Path, public_tmp: Path
) -> None:
    """Popen's cwd= would chdir as root, letting a job start inside a directory closed to its user."""
    ann, _ = plain_users
    closed = public_tmp / "roots"
    closed.mkdir(mode=0o700)
    marker = public_tmp / "ran"
    cg = Cgroup.create(cgroup_base, "j-6-a1")
    proc = spawn_gated(["/bin/sh", "-c", f"touch {marker}"], {}, str(closed), ann, cg.add,
                       stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, err = proc.communicate(timeout=PROC_TIMEOUT)
    assert proc.returncode == 125  # env's status: the directory could not be entered
    assert f"cannot change directory to '{closed}': Permission denied" in err.decode()
    assert not marker.exists()
    assert_gone(proc.pid)
    cg.remove()


def test_check_interpreter_leaves_nothing_of_the_user_behind(
    plain_users: tuple[Identity, Identity], public_tmp: Path, subreaper: None
) -> None:
    ann, _ = plain_users
    python = public_tmp / "python"
    pidfile = public_tmp / "child.pid"
    pidfile.touch()
    os.chown(pidfile, ann.uid, ann.gid)
    python.write_text(f"#!/bin/sh\n/bin/sleep 60 &\necho $! > {pidfile}\nexit 0\n")
    python.chmod(0o755)
    assert check_interpreter(ann, str(python), {"PATH": "/usr/bin:/bin"}, timeout=PROC_TIMEOUT) is None
    child = int(pidfile.read_text())
    os.waitpid(child, 0)  # killed with the check's group, reparented to this subreaper
    assert_gone(child)
