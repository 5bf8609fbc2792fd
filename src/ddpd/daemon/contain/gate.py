"""Start a rank inside its attempt's cgroup, as the submitter, before any code of the job runs.

Writing a child's pid to `cgroup.procs` after `Popen` returns is racy: the job's interpreter is the
submitter's, and its startup (sitecustomize, a .pth file, LD_PRELOAD, a wrapper script) can fork
an escapee before the daemon moves the pid. `clone3(CLONE_INTO_CGROUP)` would close the race, but
Python 3.11 has no binding for it and a raw clone3 through ctypes in a threaded interpreter is
not safe (no fork handlers: the child may deadlock on a lock another thread held).

So a rank is started through a gate: a root process in an empty environment (no user variable,
no site hook and no LD_PRELOAD reaches it) that blocks reading a pipe. The daemon moves its pid
into the cgroup, then writes the launch down the pipe. The gate drops privileges (setgroups,
setresgid, setresuid, the saved ids included: what Popen's `extra_groups=`, `group=`, `user=` do),
enters the working directory *as the user* (so a root-only directory stays closed to the job), and
execs the job's interpreter. Same pid throughout: the Popen object, its pidfd, the process group
(`process_group=`) and the fds passed with `pass_fds` are the rank's. If the daemon closes the pipe
without a launch (the cgroup move failed), the gate exits 111 having run nothing.

**One launch, two readers.** The launch is one document (`launch_script`): the umask, the
environment (`export NAME=VALUE`, every name and value quoted) and `exec env -C DIR -- ARGV`. The
ids are on the gate's command line (as setpriv's options), never anything of the job.

- *The shell gate* (where dash, setpriv and an env that takes `-C` are root's alone). Root's `dash
  -c` runs a command of the daemon's own making: it reads one line, the go-ahead, from its stdin,
  the pipe (dash's `read` takes a byte at a time, so the launch stays in the pipe), then execs
  `setpriv`, which execs a second dash, now the user's, that runs the launch from the pipe. What
  the job wrote is read by a shell only after the privileges are gone, and the environment's
  secrets are never on a command line. About 2.5 ms a rank, against 8 ms of CPU for an interpreter
  start (500 ranks: 4 s on a launch path that should take under 5 s).
- *The Python gate*, the daemon's own interpreter (`-I -S`), reads the same document (`parse`,
  which knows the four kinds of line the daemon writes and their quoting) and does the
  same with os calls. It takes what dash cannot carry: a name dash cannot export (bash's exported
  functions, `BASH_FUNC_f%%`, are common in a user's environment) or `OPTIND`, a stdin other than
  /dev/null, a launch over `SHELL_PIPE_LIMIT`, and a system without those three programs.

A start that fails before the job's interpreter runs says why from the kernel's own errno (env's
message through the shell gate; the OSError's strerror through the Python gate; nothing re-derives
it) and exits as env and the shells do: 125 the directory cannot be entered, 126 the program is
there and cannot be run, 127 it is not there.

**Nothing a user can stop is ever waited for.** The launch is written whole, non-blocking, into a
pipe sized to hold it before the gate reads a byte (`F_SETPIPE_SZ`): the daemon never waits on the
pipe's reader. Through the shell gate that reader is, after `setpriv`, the user's own dash, which
the user can SIGSTOP: a launch larger than the pipe could hold (a quoted environment grows 5-fold
with single quotes) would leave the daemon blocked in `write(2)` for good, so such a launch goes
through the Python gate instead, whose reader is root's own interpreter until it has read all of
it; there the pipe is sized too, and a remainder that still does not fit is written against a
deadline (`LAUNCH_WAIT`): a stall is a `LaunchStalled` error naming what did not start, never a
freeze. The fork and the registration of the child (`register`, e.g. `reaper.spawned`) come first;
the placement and the write run after, outside the reaper's lock.

`spawn_gated` blocks briefly (a fork, a cgroup write; a pipe write bounded by `LAUNCH_WAIT`).
"""

from __future__ import annotations

import errno
import fcntl
import functools
import os
import re
import select
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ddpd.daemon.contain.identity import RANK_UMASK, Identity

GATE_ABANDONED = 111  # the gate's exit status when the daemon gave up before the launch
# A start that failed before the job's interpreter ran exits as env(1) and the shells do: 125 the
# working directory could not be entered, 126 the program is there but cannot be run, 127 it is not
# there. Both gates: through the shell gate these are env's own statuses.
GATE_NO_DIRECTORY, GATE_CANNOT_RUN, GATE_NOT_FOUND = 125, 126, 127
LAUNCH_WAIT = 5.0  # seconds the daemon gives root's own (Python) gate to read a launch larger than its pipe
SHELL_PIPE_LIMIT = 1 << 20  # bytes: a shell launch above this goes through the Python gate (see the module)


class LaunchStalled(OSError):
    """The gate did not read its launch within LAUNCH_WAIT (what it was to start did not start)."""


# The launch, in the one form both gates read: lines of words, each of the job's words quoted by
# `launch_script` ('...' runs, and "'" for a quote; the daemon's own words bare). The user's dash
# runs it; the Python gate reads it with `parse` (below, also run by the tests against every kind
# of value), which knows the four kinds of line the daemon writes: `umask`, `unset`, `export
# NAME=VALUE` and `exec ENV -C DIR -- ARGV... </dev/null`. A quoted run is found with `index` (C
# speed); only the bare words go a byte at a time.
PARSE_SOURCE = r"""
def parse(data):
    umask, env, cwd, argv = 0o22, {}, b"/", []
    lines, words, i, n = [], [], 0, len(data)
    while i < n:
        c = data[i]
        if c == 10:
            lines.append(words)
            words, i = [], i + 1
            continue
        if c == 32:
            i += 1
            continue
        word = bytearray()
        while i < n and data[i] not in (10, 32):
            if data[i] in (34, 39):
                j = data.index(data[i:i + 1], i + 1)
                word += data[i + 1:j]
                i = j + 1
            else:
                word.append(data[i])
                i += 1
        words.append(bytes(word))
    for words in lines:
        if words[0] == b"umask":
            umask = int(words[1], 8)
        elif words[0] == b"export":
            name, _, value = words[1].partition(b"=")
            env[name] = value
        elif words[0] == b"exec":
            cwd, argv = words[3], words[5:-1]
    return umask, env, cwd, argv
"""

GATE_SOURCE = PARSE_SOURCE + rf"""
import os, sys
fd = int(sys.argv[1])
chunks = []
while True:
    chunk = os.read(fd, 65536)
    if not chunk:
        break
    chunks.append(chunk)
os.close(fd)
if not chunks:
    os._exit({GATE_ABANDONED})
umask, env, cwd, argv = parse(b"".join(chunks))
if len(sys.argv) > 2:
    uid, gid = int(sys.argv[2]), int(sys.argv[3])
    os.setgroups([int(g) for g in sys.argv[4].split(",") if g])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
os.umask(umask)
try:
    os.chdir(cwd)
except OSError as exc:
    os.write(2, b"ddpd: cannot change directory to '" + cwd + b"': " + exc.strerror.encode() + b"\n")
    os._exit({GATE_NO_DIRECTORY})
try:
    os.execve(argv[0], argv, env)
except OSError as exc:
    os.write(2, b"ddpd: '" + argv[0] + b"': " + exc.strerror.encode() + b"\n")
    os._exit({GATE_NOT_FOUND} if exc.errno == 2 else {GATE_CANNOT_RUN})
"""

_parsed: dict[str, Any] = {}
exec(PARSE_SOURCE, _parsed)
parse_launch: Callable[[bytes], tuple[int, dict[bytes, bytes], bytes, list[bytes]]] = _parsed["parse"]


@dataclass(frozen=True)
class ShellGate:
    dash: str
    setpriv: str
    env: str


SHELL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
SHELL_CHECKED = frozenset({"OPTIND"})  # names dash checks the value of (a non-number ends it)
ENV_PATHS = ("/usr/bin/env", "/bin/env")


def _root_only(path: str) -> bool:
    """Whether `path` is a regular file that only root can change, in directories only root can change."""
    try:
        real = os.path.realpath(path)
        st = os.stat(real)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
            return False
        parent = os.path.dirname(real)
        while True:
            d = os.stat(parent)
            if d.st_uid != 0 or d.st_mode & 0o022:
                return False
            if parent == "/":
                return True
            parent = os.path.dirname(parent)
    except OSError:
        return False


def _enters(env: str) -> bool:
    """Whether `env` takes `-C DIR` (GNU coreutils 8.28 and later; busybox's does not)."""
    try:
        return subprocess.run([env, "-C", "/", "--", env, "true"], env={}, stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=5).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@functools.cache
def shell_gate() -> ShellGate | None:
    """dash, setpriv and an env that takes -C, where all three are there and root's alone (else the
    Python gate)."""
    def first(*paths: str) -> str | None:
        return next((p for p in paths if _root_only(p)), None)

    dash, setpriv = first("/usr/bin/dash", "/bin/dash"), first("/usr/bin/setpriv", "/bin/setpriv")
    env = first(*ENV_PATHS)
    return ShellGate(dash, setpriv, env) if dash and setpriv and env and _enters(env) else None


def _quote(text: str) -> str:
    """`text` as one shell word, always in single quotes (a quote as '"'"', as shlex.quote writes
    it): what the Python gate reads a byte at a time is only the daemon's own words."""
    return "'" + text.replace("'", "'\"'\"'") + "'"


def launch_script(argv: Sequence[str], env: Mapping[str, str], cwd: str, umask: int = RANK_UMASK) -> bytes:
    """The launch both gates read (see PARSE_SOURCE). dash runs it as the user: `unset` its own PWD
    and OLDPWD (the job's, where it has them, are exported after), the environment exported (every
    name and value quoted: nothing of the job is read as code), then `env -C` enters the directory
    with chdir(2) as the user and execs the job's interpreter: a failure is the kernel's errno in
    env's words, with env's status (GATE_NO_DIRECTORY, GATE_CANNOT_RUN, GATE_NOT_FOUND)."""
    if not argv or not os.path.isabs(argv[0]):
        raise ValueError("argv[0] must be an absolute path to the job's interpreter")
    if not os.path.isabs(cwd):
        raise ValueError(f"cwd must be an absolute path, not {cwd!r}")
    gate = shell_gate()
    lines = [
        f"umask {umask:04o}",
        "unset PWD OLDPWD",
        *(f"export {_quote(k)}={_quote(v)}" for k, v in env.items()),
        f"exec {gate.env if gate else ENV_PATHS[0]} -C {_quote(cwd)} -- {' '.join(map(_quote, argv))} </dev/null",
    ]
    return ("\n".join(lines) + "\n").encode("utf-8", "surrogateescape")


def shell_carries(env: Mapping[str, str]) -> bool:
    """Whether dash can export every name of `env` (a shell name, and not one dash checks the value
    of); else the launch goes through the Python gate (`BASH_FUNC_f%%`, bash's exported functions,
    is the common case)."""
    return all(SHELL_NAME.fullmatch(k) and k not in SHELL_CHECKED for k in env)


def gate_said(line: str) -> bool:
    """Whether a line of stderr is a gate's own (a failed start: env's, or the Python gate's)."""
    return line.startswith(("ddpd: ", *(f"{path}: " for path in ENV_PATHS)))


def _gate_command(gate: ShellGate, identity: Identity | None) -> list[str]:
    """Root's dash: read the go-ahead line (byte by byte: the launch after it stays in the pipe), then
    a dash as the user runs the launch from the pipe. Ids and root's own paths only."""
    then = f"{gate.dash} -s"
    if identity is not None:
        groups = f"--groups={','.join(str(g) for g in identity.groups)}" if identity.groups else "--clear-groups"
        then = f"{gate.setpriv} --reuid={identity.uid} --regid={identity.gid} {groups} -- {then}"
    return [gate.dash, "-c", f"read -r _ || exit {GATE_ABANDONED}; exec {then}"]


def _python_gate_command(fd: int, identity: Identity | None) -> list[str]:
    """Root's own interpreter, isolated, reading the launch from `fd`; the ids on its command line, as
    setpriv's are."""
    ids = [] if identity is None else [str(identity.uid), str(identity.gid), ",".join(map(str, identity.groups))]
    return [sys.executable, "-I", "-S", "-c", GATE_SOURCE, str(fd), *ids]


Register = Callable[[Callable[[], "subprocess.Popen[bytes]"]], "subprocess.Popen[bytes]"]


def _direct(start: Callable[[], subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
    return start()


def size_pipe(fd: int, size: int) -> int:
    """Grow the pipe of `fd` to hold `size` bytes where the kernel lets us (root may pass
    /proc/sys/fs/pipe-max-size); its capacity afterwards."""
    capacity = fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ)
    if size > capacity:
        try:
            capacity = fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, size)
        except OSError:  # over the per-user pipe budget, or pipe-max-size without CAP_SYS_RESOURCE
            pass
    return capacity


def write_launch(fd: int, data: bytes, deadline: float, what: str) -> None:
    """Write `data` into the (non-blocking) pipe `fd`, waiting for its reader until `deadline` at most."""
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
            continue
        except BlockingIOError:
            pass
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([], [fd], [], left)[1]:
            raise LaunchStalled(errno.ETIMEDOUT, f"{what} did not read its launch within {LAUNCH_WAIT:g} s")


def spawn_gated(
    argv: Sequence[str],
    env: Mapping[str, str],
    cwd: str,
    identity: Identity | None,
    place: Callable[[int], None],
    shell: bool = True,
    umask: int = RANK_UMASK,
    register: Register = _direct,
    what: str = "the gate",
    **popen: Any,
) -> subprocess.Popen[bytes]:
    """Start `argv` through the gate; `place(pid)` (e.g. `Cgroup.add`) runs before it execs.

    `popen` goes to Popen (stdin, stdout, stderr, pass_fds, process_group...); `env`, `cwd`,
    `user`, `group`, `extra_groups` and `umask` are the gate's business and refused here. A root
    daemon passes the submitter's `identity`; a per-user daemon passes None. `register` runs the
    fork (e.g. `reaper.spawned`, which holds its lock for the fork only). If `place` raises, or the
    gate does not take its launch in time (`LaunchStalled`, naming `what`), the gate is abandoned
    (exits 111 having run nothing, or is killed), reaped, and the error propagates. `shell` False:
    the Python gate even where the shell gate could go. Through the shell gate the child's stdin is
    /dev/null (the only stdin it takes: None or DEVNULL; any other goes the Python way).
    """
    refused = {"env", "cwd", "user", "group", "extra_groups", "preexec_fn", "executable"} & popen.keys()
    if refused:
        raise TypeError(f"spawn_gated sets {sorted(refused)} itself")
    stdin_null = popen.get("stdin") in (None, subprocess.DEVNULL)
    script = launch_script(argv, env, cwd, umask)
    gate = shell_gate() if shell and stdin_null and shell_carries(env) else None
    if len(script) + 1 > SHELL_PIPE_LIMIT:
        gate = None  # its reader would be the user's dash: only what the pipe holds may go that way
    # the shell gate's pipe is its stdin: the go-ahead line, then the launch its user's dash runs
    document = script if gate is None else b"\n" + script
    read_end, write_end = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
    os.set_blocking(read_end, True)
    if size_pipe(write_end, len(document)) < len(document) and gate is not None:
        gate, document = None, script  # (the pipe could not grow to hold it: root's gate reads it)
    try:
        pass_fds = tuple(popen.pop("pass_fds", ()))
        if gate is not None:
            command = _gate_command(gate, identity)
            popen["stdin"] = read_end
        else:
            command = _python_gate_command(read_end, identity)
            pass_fds = (*pass_fds, read_end)
        proc = register(lambda: subprocess.Popen(command, env={}, cwd="/", pass_fds=pass_fds, close_fds=True,
                                                 **popen))
    except BaseException:
        os.close(write_end)
        raise
    finally:
        os.close(read_end)
    try:
        place(proc.pid)
        # whole: the pipe holds it all, so this write never waits; else the reader is root's gate
        write_launch(write_end, document, time.monotonic() + LAUNCH_WAIT, what)
    except BaseException:
        if isinstance(sys.exc_info()[1], LaunchStalled):
            proc.kill()
        os.close(write_end)
        proc.wait()
        raise
    os.close(write_end)
    return proc
