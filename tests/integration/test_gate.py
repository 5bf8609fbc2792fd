"""Both gates (the shell gate: dash and setpriv; the Python gate) with real processes, as root, with a
user created for the test: the child runs exactly the environment, directory, umask, ids (saved
ones included) and descriptors it was given, whatever the environment's values hold; a failed
start says why in the gate's words with the same exit status; nothing of the job reaches root's
shell; and the shell gate is refused where its programs are not root's alone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

from ddpd.daemon.contain import gate as gate_mod
from ddpd.daemon.contain.gate import gate_said, shell_carries, shell_gate, spawn_gated
from ddpd.daemon.contain.identity import Identity
from ddpd.daemon.control.interpreters import check_interpreter
from tests.conftest import assert_gone

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root"),
    pytest.mark.xdist_group("users"),  # useradd/userdel lock /etc/passwd: one worker at a time
    pytest.mark.public_tmp(0o711),  # traversable, not listable
]

PROC_TIMEOUT = 30
SYSTEM_PYTHON = "/usr/bin/python3.11" if os.path.exists("/usr/bin/python3.11") else "/usr/bin/python3"
REPORT = r"""
import json, os, sys
fds = sorted(int(f) for f in os.listdir("/proc/self/fd"))
status = dict(l.split(":", 1) for l in open("/proc/self/status").read().splitlines() if ":" in l)
print(json.dumps({"env": dict(os.environ), "cwd": os.getcwd(), "fds": fds, "argv": sys.argv[1:],
                  "stdin": os.readlink("/proc/self/fd/0"), "uid": status["Uid"].split(),
                  "gid": status["Gid"].split(), "groups": sorted(int(g) for g in status["Groups"].split()),
                  "umask": status["Umask"].strip()}))
"""
ODD = {  # what a shell would read as code, were it not quoted
    "QUOTES": "it's \"quoted\" `uname` $(touch /tmp/ddpd-gate-pwned) $HOME \\ ;|&<>*?[]{}~#!",
    "NEWLINES": "line one\nline two\n\nexport PWNED=1\n",
    "UNICODE": "päivää 日本 \u200b",
    "EMPTY": "",
    "PWD": "/somewhere/else",  # dash's own variable: the job's value wins
    "IFS": " ",
    "PATH": "/nonexistent",
    "LD_PRELOAD": "/nonexistent/lib.so",  # the user's own, for its own interpreter: passed on
    "PYTHONCOERCECLOCALE": "0",  # (else the child's python adds LC_CTYPE to what it was given)
}


@pytest.fixture(scope="module")
def ann(plain_users: tuple[Identity, Identity]) -> Identity:
    return plain_users[0]


def gated(argv: list[str], env: dict[str, str], cwd: str, who: Identity | None, shell: bool,
          **popen: object) -> tuple[int, str, str, int]:
    proc = spawn_gated(argv, env, cwd, who, lambda pid: None, shell=shell, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, **popen)
    out, err = proc.communicate(timeout=PROC_TIMEOUT)
    assert_gone(proc.pid)
    return proc.returncode, out.decode(), err.decode(), proc.pid


@pytest.fixture(params=[True, False], ids=["shell", "python"])
def shell(request: pytest.FixtureRequest) -> bool:
    if request.param and shell_gate() is None:
        pytest.fail("dash, setpriv and env (root's) are expected on this machine: the shell gate is the default path")
    return bool(request.param)


def test_the_child_runs_exactly_what_it_was_given(ann: Identity, public_tmp: Path, shell: bool) -> None:
    real = public_tmp / "work"
    (real / "sub").mkdir(parents=True)
    (public_tmp / "link").symlink_to(real / "sub")
    cwd = str(public_tmp / "link" / "..")  # `..` of a symlink: the kernel's answer (work), not the path's
    env = {**ODD, **ann.identity_env(), "MINE": "x" * 100_000}  # bigger than a pipe's buffer
    extra_r, extra_w = os.pipe()
    try:
        code, out, err, _ = gated([SYSTEM_PYTHON, "-c", REPORT, "a b", "$HOME", "'"], env, cwd, ann, shell,
                                  pass_fds=(extra_w,))
    finally:
        os.close(extra_r)
        os.close(extra_w)
    assert code == 0, err
    seen = json.loads(out)
    assert seen["env"] == env
    assert seen["cwd"] == str(real)
    assert seen["argv"] == ["a b", "$HOME", "'"]
    assert len([fd for fd in seen["fds"] if fd not in (0, 1, 2, extra_w)]) == 1  # the listing's own
    assert seen["stdin"] == "/dev/null"
    assert seen["uid"] == [str(ann.uid)] * 4 and seen["gid"] == [str(ann.gid)] * 4  # saved ids too
    assert seen["groups"] == sorted(ann.groups)
    assert seen["umask"] == "0077"
    assert not Path("/tmp/ddpd-gate-pwned").exists()


def test_the_fds_the_child_holds_are_only_what_it_was_given(ann: Identity, shell: bool) -> None:
    code, out, err, _ = gated([SYSTEM_PYTHON, "-c", "import os; print(sorted(os.listdir('/proc/self/fd')))"],
                              {}, "/", ann, shell)
    assert code == 0, err
    assert out.strip() == "['0', '1', '2', '3']"  # 3: the listing's own


def test_a_failed_start_says_why_with_the_gates_status(ann: Identity, public_tmp: Path, shell: bool) -> None:
    """The kernel's errno, as env(1) says it (the shell gate runs env) or as the OSError's strerror (the
    Python gate), with env's exit status: 125 the directory, 126 there but not runnable, 127 not there."""
    closed = public_tmp / "closed"
    closed.mkdir(mode=0o700)
    a_file = public_tmp / "file"
    a_file.write_text("")
    cases = [
        (SYSTEM_PYTHON, str(public_tmp / "missing"), 125, "No such file or directory"),
        (SYSTEM_PYTHON, str(closed), 125, "Permission denied"),
        (SYSTEM_PYTHON, str(a_file), 125, "Not a directory"),
        (str(public_tmp / "nope"), "/", 127, "No such file or directory"),
        (str(a_file), "/", 126, "Permission denied"),  # not executable
        (str(closed / "python"), "/", 126, "Permission denied"),  # a closed directory on the way
        (SYSTEM_PYTHON, str(closed / "sub"), 125, "Permission denied"),
        (str(a_file / "python"), "/", 126, "Not a directory"),  # a file on the way
        (SYSTEM_PYTHON, str(a_file / "sub"), 125, "Not a directory"),
        (str(public_tmp), "/", 126, "Permission denied"),  # a directory to run
        (str(public_tmp / "to-closed"), "/", 126, "Permission denied"),  # a link into a closed directory
        (str(public_tmp / "dangling"), "/", 127, "No such file or directory"),
    ]
    (public_tmp / "to-closed").symlink_to(closed / "python")
    (closed / "python").symlink_to(SYSTEM_PYTHON)  # (there, but not for the user)
    (public_tmp / "dangling").symlink_to("nowhere/python")
    for program, cwd, status, why in cases:
        code, out, err, _ = gated([program, "-c", "print('ran')"], {"LC_ALL": "C"}, cwd, ann, shell)
        assert (code, out) == (status, ""), (program, cwd, err)
        said = f"cannot change directory to '{cwd}': {why}" if status == 125 else f"'{program}': {why}"
        assert gate_said(err) and err.startswith("ddpd: ") != shell and said in err, err


def test_a_launch_the_shell_cannot_carry_goes_the_python_way(ann: Identity) -> None:
    env = {"NOT-A-SHELL-NAME": "1", "OPTIND": "not a number", "PYTHONCOERCECLOCALE": "0",
           "BASH_FUNC_f%%": "() {  echo 'hi'\n}", "a b": "c"}
    assert not shell_carries(env)
    code, out, err, _ = gated([SYSTEM_PYTHON, "-c", "import json, os; print(json.dumps(dict(os.environ)))"],
                              env, "/", ann, shell=True)
    assert code == 0, err
    assert json.loads(out) == env


def test_the_shell_gate_runs_as_the_daemon_without_an_identity(public_tmp: Path) -> None:
    code, out, err, _ = gated([SYSTEM_PYTHON, "-c", "import os; print(os.getuid(), os.getcwd())"],
                              {"A": "1"}, str(public_tmp), None, shell=True)
    assert (code, out.split()) == (0, ["0", str(public_tmp)]), err


def test_nothing_runs_when_the_daemon_gives_up_before_the_launch(public_tmp: Path, shell: bool) -> None:
    marker = public_tmp / "ran"

    def refuse(pid: int) -> None:
        raise OSError(1, "placement refused")

    with pytest.raises(OSError, match="placement refused"):
        spawn_gated(["/bin/sh", "-c", f"touch {marker}"], {}, "/", None, refuse, shell=shell)
    assert not marker.exists()


def test_the_shell_gate_is_refused_where_its_programs_are_not_roots_alone(public_tmp: Path) -> None:
    assert not gate_mod._root_only(str(public_tmp / "dash"))  # missing
    in_tmp = public_tmp / "dash"
    in_tmp.write_bytes(b"\x7fELF")
    in_tmp.chmod(0o755)
    assert not gate_mod._root_only(str(in_tmp))  # /tmp: anyone may make names there
    with tempfile.TemporaryDirectory(dir="/run") as base:  # root's 0755 all the way up
        _refused_unless_roots_alone(Path(base))


def _refused_unless_roots_alone(base: Path) -> None:
    open_dir = base / "bin"
    open_dir.mkdir()
    open_dir.chmod(0o777)  # anyone could swap the program
    copy = open_dir / "dash"
    copy.write_bytes(b"\x7fELF")
    copy.chmod(0o755)
    assert not gate_mod._root_only(str(copy))
    open_dir.chmod(0o755)
    assert gate_mod._root_only(str(copy))
    copy.chmod(0o775)  # group-writable
    assert not gate_mod._root_only(str(copy))
    os.chown(copy, 1, -1)
    copy.chmod(0o755)
    assert not gate_mod._root_only(str(copy))  # not root's
    assert gate_mod._root_only("/usr/bin/env")


# Round 3, G1: a launch larger than a pipe, and a reader that never reads (the gate stopped before it
# reads a byte: what a user did to its own dash after setpriv, without the race)
BIG = {"PATH": "/usr/bin:/bin", "QUOTES": "'" * 60_000, "MORE": "x" * 100_000}


def _stopped(pids: list[int]) -> Callable[[int], None]:
    def place(pid: int) -> None:
        os.kill(pid, signal.SIGSTOP)
        pids.append(pid)
    return place


T = TypeVar("T")


def _within(start: Callable[[], T], pids: list[int], bound: float) -> T:
    """`start()` in a thread, which must return within `bound` s (else the stopped gate is killed, so
    the thread's blocked write ends, and the test fails)."""
    box: list[T | BaseException] = []

    def run() -> None:
        try:
            box.append(start())
        except BaseException as exc:
            box.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(bound)
    if thread.is_alive():
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        thread.join(PROC_TIMEOUT)
        pytest.fail(f"the start blocked on its stopped gate for more than {bound} s")
    result = box[0]
    if isinstance(result, BaseException):
        raise result
    return result


@pytest.mark.parametrize("shell", [True, False], ids=["shell", "python"])
def test_a_stopped_gate_never_blocks_the_start_of_a_launch_larger_than_a_pipe(ann: Identity, shell: bool) -> None:
    """Bug: the daemon wrote a launch larger than the pipe with a blocking write, so a gate that did
    not read (the user's own dash, SIGSTOPped by the user) held the daemon's thread for good."""
    pids: list[int] = []
    proc = _within(lambda: spawn_gated([SYSTEM_PYTHON, "-c", "print('ran')"], BIG, "/", ann, _stopped(pids),
                                             shell=shell, stdout=subprocess.PIPE), pids, 2.0)
    os.kill(proc.pid, signal.SIGCONT)  # once it reads on, it runs what it was given, all of it
    out, _ = proc.communicate(timeout=PROC_TIMEOUT)
    assert (proc.returncode, out) == (0, b"ran\n")
    assert_gone(proc.pid)


def test_a_stopped_interpreter_check_is_refused_within_its_timeout(ann: Identity) -> None:
    """Bug (as above, through the interpreter check, which also held the reaper's lock: every
    later start froze behind it)."""
    pids: list[int] = []
    start = time.monotonic()
    why = _within(lambda: check_interpreter(ann, SYSTEM_PYTHON, BIG, 2.0, None, _stopped(pids)), pids, 10.0)
    assert why is not None and "did not finish" in why, why
    assert time.monotonic() - start < 10
    for pid in pids:
        assert_gone(pid)
