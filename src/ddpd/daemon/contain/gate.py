"""Start a rank inside its attempt's cgroup, as the submitter, before any code of the job runs.

Writing a child's pid to `cgroup.procs` after `Popen` returns is racy: the job's interpreter is the
submitter's, and its startup (sitecustomize, a .pth file, LD_PRELOAD, a wrapper script) can fork
an escapee before the daemon moves the pid. `clone3(CLONE_INTO_CGROUP)` would close the race, but
Python 3.11 has no binding for it and a raw clone3 through ctypes in a threaded interpreter is
not safe (no fork handlers: the child may deadlock on a lock another thread held).

So a rank is started through a gate: the daemon's own interpreter, isolated (`-I -S`, an empty
environment, so no user variable, no site hook and no LD_PRELOAD reaches it), running as root. It
blocks reading a pipe. The daemon moves its pid into the cgroup, then writes the launch (argv,
environment, working directory, identity, umask) down the pipe. The gate then drops privileges
(setgroups, setresgid, setresuid: the same as Popen's `extra_groups=`, `group=`, `user=`), enters
the working directory *as the user* (so a root-only directory stays closed to the job), and
`execve`s the job's interpreter. Same pid throughout: the Popen object, its pidfd, the process
group (`process_group=`) and the fds passed with `pass_fds` are the rank's. If the daemon closes
the pipe without a launch (the cgroup move failed), the gate exits 111 having run nothing.

**The shell gate.** An interpreter start is about 8 ms of CPU a rank (500 ranks: 4 s of CPU on a
launch path that should take under 5 s), so where the system has them, the gate is dash and
setpriv instead, about 2.5 ms. Root's `dash -c`, in the empty environment, runs a command of the
daemon's own making (ids and two root-owned paths; nothing of the job): it reads one line from
its stdin, the pipe (dash's `read` takes a byte at a time, so what follows stays in the pipe);
the daemon places it and writes the go-ahead line and then the launch; it execs `setpriv`
(setresgid, setgroups, setresuid, the saved ids included), which execs a second dash, now the
user's, reading the rest of the pipe as its commands: the umask, `cd -P` into the working
directory, the environment (`export`, every value quoted), and the `exec` of the job's
interpreter with stdin from /dev/null. What the job wrote is read by a shell only after the
privileges are gone, and its environment's secrets are never on a command line. The same exit
statuses and messages ("ddpd: cannot start ... [Errno N] ...") as the Python gate, which stays
for what the shell gate cannot carry (an environment name that is not a shell name, a stdin other
than /dev/null) and where dash or setpriv is missing or not root's alone.

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
import marshal
import os
import re
import select
import shlex
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ddpd.daemon.contain.identity import RANK_UMASK, Identity

GATE_ABANDONED = 111  # the gate's exit status when the daemon gave up before the launch
GATE_EXEC_FAILED = 127  # its exit status when the job's interpreter could not be started (as a shell's)
LAUNCH_WAIT = 5.0  # seconds the daemon gives root's own (Python) gate to read a launch larger than its pipe
SHELL_PIPE_LIMIT = 1 << 20  # bytes: a shell launch above this goes through the Python gate (see the module)


class LaunchStalled(OSError):
    """The gate did not read its launch within LAUNCH_WAIT (what it was to start did not start)."""

GATE_SOURCE = rf"""
import marshal, os, sys
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
launch = marshal.loads(b"".join(chunks))
try:
    if launch["uid"] is not None:
        os.setgroups(launch["groups"])
        os.setresgid(launch["gid"], launch["gid"], launch["gid"])
        os.setresuid(launch["uid"], launch["uid"], launch["uid"])
    os.umask(launch["umask"])
    os.chdir(launch["cwd"])
    os.execve(launch["argv"][0], launch["argv"], launch["env"])
except OSError as exc:
    os.write(2, f"ddpd: cannot start {{launch['argv'][0]}} in {{launch['cwd']}}: {{exc}}\n".encode())
    os._exit({GATE_EXEC_FAILED})
"""


def launch_document(
    argv: Sequence[str], env: Mapping[str, str], cwd: str, identity: Identity | None, umask: int = RANK_UMASK
) -> bytes:
    """What the daemon writes down the gate's pipe (identity None: keep the daemon's own)."""
    if not argv or not os.path.isabs(argv[0]):
        raise ValueError("argv[0] must be an absolute path to the job's interpreter")
    if not os.path.isabs(cwd):
        raise ValueError(f"cwd must be an absolute path, not {cwd!r}")
    doc: dict[str, Any] = {
        "argv": list(argv),
        "env": dict(env),
        "cwd": cwd,
        "umask": umask,
        "uid": identity.uid if identity else None,
        "gid": identity.gid if identity else None,
        "groups": list(identity.groups) if identity else [],
    }
    # marshal, not json: the gate reads only what the daemon wrote, and marshal is built in (importing
    # json took a third of the gate's start, paid once per rank)
    return marshal.dumps(doc)


@dataclass(frozen=True)
class ShellGate:
    dash: str
    setpriv: str


SHELL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
SHELL_CHECKED = frozenset({"OPTIND"})  # names dash checks the value of (a non-number ends it)


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


@functools.cache
def shell_gate() -> ShellGate | None:
    """dash and setpriv, where both are there and root's alone (else the Python gate)."""
    def first(*paths: str) -> str | None:
        return next((p for p in paths if _root_only(p)), None)

    dash, setpriv = first("/usr/bin/dash", "/bin/dash"), first("/usr/bin/setpriv", "/bin/setpriv")
    return ShellGate(dash, setpriv) if dash and setpriv else None


# Why the user cannot reach path $1 (a `dir` to enter, or a `file` to run), as the Python gate's
# chdir/execve would say: a closed directory on the way, a missing name, a name on the way that is
# not a directory; else (all there) not a directory to enter, or not a file it may run. A symbolic
# link whose target is out of reach is followed (`readlink`, on this failure path only).
WHY = """ddpd_why() {
  ddpd_at= ddpd_rest=${1#/} ddpd_hops=0
  while [ -n "$ddpd_rest" ]; do
    [ -x "${ddpd_at:-/}" ] || ddpd_fail 13 'Permission denied'
    ddpd_at=$ddpd_at/${ddpd_rest%%/*}
    case $ddpd_rest in */*) ddpd_rest=${ddpd_rest#*/} ;; *) ddpd_rest= ;; esac
    if [ -L "$ddpd_at" ] && ! [ -e "$ddpd_at" ] && [ "$ddpd_hops" -lt 40 ]; then
      ddpd_hops=$((ddpd_hops + 1))
      ddpd_to=$(readlink -- "$ddpd_at") || ddpd_fail 13 'Permission denied'
      case $ddpd_to in /*) ;; *) ddpd_to=${ddpd_at%/*}/$ddpd_to ;; esac
      ddpd_at= ddpd_rest=${ddpd_to#/}${ddpd_rest:+/$ddpd_rest}
      continue
    fi
    [ -e "$ddpd_at" ] || ddpd_fail 2 'No such file or directory'
    [ -z "$ddpd_rest" ] || [ -d "$ddpd_at" ] || ddpd_fail 20 'Not a directory'
  done
  [ "$2" = file ] || [ -d "$1" ] || ddpd_fail 20 'Not a directory'
  ddpd_fail 13 'Permission denied'
}"""


def shell_launch(argv: Sequence[str], env: Mapping[str, str], cwd: str, umask: int = RANK_UMASK) -> bytes | None:
    """What the user's dash reads and runs (`ShellGate`), or None when the shell cannot carry it (a
    name in the environment that is not a shell name, or one dash checks). `cd -P`: the directory
    the kernel resolves, as chdir(2) does (dash's logical `cd` reads `..` on the path)."""
    if not argv or not os.path.isabs(argv[0]):
        raise ValueError("argv[0] must be an absolute path to the job's interpreter")
    if not os.path.isabs(cwd):
        raise ValueError(f"cwd must be an absolute path, not {cwd!r}")
    if not all(SHELL_NAME.fullmatch(k) and k not in SHELL_CHECKED for k in env):
        return None
    q = shlex.quote
    program, where = q(argv[0]), q(cwd)
    lines = [
        f"ddpd_fail() {{ printf 'ddpd: cannot start %s in %s: [Errno %s] %s\\n' {program} {where} \"$1\" \"$2\" >&2;"
        f" exit {GATE_EXEC_FAILED}; }}",
        WHY,
        f"umask {umask:04o}",
        f"cd -P -- {where} 2>/dev/null || ddpd_why {where} dir",
        f"[ -f {program} ] && [ -x {program} ] || ddpd_why {program} file",
        "unset PWD OLDPWD",  # dash's own; the job's are exported below where it has them
        *(f"export {k}={q(v)}" for k, v in env.items()),
        "exec " + " ".join(q(a) for a in argv) + " </dev/null",  # its stdin was this launch
    ]
    return ("\n".join(lines) + "\n").encode("utf-8", "surrogateescape")


def _gate_command(gate: ShellGate, identity: Identity | None) -> list[str]:
    """Root's dash: read the go-ahead line (byte by byte: the launch after it stays in the pipe), then
    a dash as the user runs the launch from the pipe. Ids and root's own paths only."""
    then = f"{gate.dash} -s"
    if identity is not None:
        groups = f"--groups={','.join(str(g) for g in identity.groups)}" if identity.groups else "--clear-groups"
        then = f"{gate.setpriv} --reuid={identity.uid} --regid={identity.gid} {groups} -- {then}"
    return [gate.dash, "-c", f"read -r _ || exit {GATE_ABANDONED}; exec {then}"]


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
    gate = shell_gate() if shell and stdin_null else None
    script = None if gate is None else shell_launch(argv, env, cwd, umask)
    if script is not None and len(script) + 1 > SHELL_PIPE_LIMIT:
        script = None  # its reader would be the user's dash: only what the pipe holds may go that way
    # the shell gate's pipe is its stdin: the go-ahead line, then the launch its user's dash runs
    document = launch_document(argv, env, cwd, identity, umask) if script is None else b"\n" + script
    read_end, write_end = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
    os.set_blocking(read_end, True)
    whole = size_pipe(write_end, len(document)) >= len(document)
    if script is not None and not whole:
        script, document = None, launch_document(argv, env, cwd, identity, umask)
        size_pipe(write_end, len(document))
    try:
        pass_fds = tuple(popen.pop("pass_fds", ()))
        if gate is not None and script is not None:
            command = _gate_command(gate, identity)
            popen["stdin"] = read_end
        else:
            command = [sys.executable, "-I", "-S", "-c", GATE_SOURCE, str(read_end)]
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
