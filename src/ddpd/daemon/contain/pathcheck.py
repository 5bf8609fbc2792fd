"""A submit's paths (its working directory, its script) checked as its submitter, never as root.

Root can stat anything: a check made by the daemon itself told any submitter whether `/root/.bashrc`
or a file in another user's 0700 home exists (issue 34, finding 7). So the check runs in a helper:
root's own interpreter, isolated (`-I -S`, an empty environment: nothing of the user's reaches it
while it is root), reads what to check from its stdin (never a command line others can read), drops
to the submitter's groups and ids (setgroups, setresgid, setresuid: all of them, saved ones too, so
its capabilities go), and only then looks: `chdir` into the working directory (what the gate's
`cd -P` does before the job runs), then `stat` and `access(R_OK)` of the script, relative to it. It
prints one line, `ok` or `FIELD CODE` (an errno name, or `ENOTREG`), and the refusal is worded from
that code alone: the submitter learns only what it could have learnt with its own `ls` (a path
under a directory closed to it says "permission denied" whether or not it exists).

Bounded: the helper is killed after `timeout` seconds (a hung network file system, or the user's
own process stopped by the user once the ids are dropped), its group with it; a helper that does
not die within KILL_WAIT is handed to the reaper of inherited children. `check_paths_as` blocks
(a process start, about 10 ms): call it via anyio.to_thread.
"""

from __future__ import annotations

import errno
import marshal
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

from .identity import Identity
from .reaper import disown, spawned

KILL_WAIT = 1.0  # seconds for a killed helper to be reaped before the reaper is left to do it
OUTPUT_LIMIT = 4096  # bytes of the helper's answer read

HELPER = r"""
import errno, marshal, os, stat, sys
uid, gid, groups, workdir, script = marshal.loads(sys.stdin.buffer.read())
if os.geteuid() == 0 and uid != 0:
    os.setgroups(groups)
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)

def code(exc):
    return errno.errorcode.get(exc.errno or 0, "EIO") if isinstance(exc, OSError) else "EINVAL"

try:
    if workdir is not None:
        os.chdir(workdir)
except (OSError, ValueError) as exc:
    print("workdir", code(exc), flush=True)
    sys.exit(0)
try:
    if script is not None:
        if not stat.S_ISREG(os.stat(script).st_mode):
            print("script ENOTREG", flush=True)
            sys.exit(0)
        if not os.access(script, os.R_OK):
            print("script EACCES", flush=True)
            sys.exit(0)
except (OSError, ValueError) as exc:
    print("script", code(exc), flush=True)
    sys.exit(0)
print("ok", flush=True)
"""


@dataclass(frozen=True)
class PathProblem:
    """Why a path of the spec cannot serve the job: the spec's field and a message for the submitter."""

    field: str
    message: str


def _words(code: str, path: str, who: str, field: str) -> str:
    """The submitter's view of `code` for `path`: what its own `ls` or `cd` would say."""
    if code == "ENOENT" or (code == "ENOTDIR" and field == "script"):
        return f"{path} does not exist"
    if code == "ENOTDIR":
        return f"{path} is not a directory"
    if code == "ENOTREG":
        return f"{path} is not a regular file"
    if code == "EACCES":
        return f"{path}: permission denied to {who}: it, or a directory on its path, is closed to that user"
    number = getattr(errno, code, None)
    reason = os.strerror(number) if isinstance(number, int) else code
    return f"{path}: {reason} (as {who})"


def check_paths_as(identity: Identity, workdir: str | None, script: str | None, timeout: float,
                   register: Callable[[Callable[[], subprocess.Popen[bytes]]], subprocess.Popen[bytes]] = spawned,
                   ) -> PathProblem | None:
    """Why `workdir` (entered) or `script` (a readable regular file, relative to `workdir`) cannot
    serve a job of `identity`, as that user sees them; None when both can (see the module)."""
    if workdir is None and script is None:
        return None
    who = f"user {identity.name} (uid {identity.uid})"
    payload = marshal.dumps((identity.uid, identity.gid, list(identity.groups), workdir, script))
    proc = register(lambda: subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", HELPER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, env={}, cwd="/", close_fds=True, process_group=0))
    try:
        out, _ = proc.communicate(payload, timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(proc)
        return PathProblem("workdir" if workdir is not None else "script",
                           f"its paths could not be checked as {who} within {timeout:g} s "
                           "(a file system that does not answer?)")
    words = out[:OUTPUT_LIMIT].decode(errors="replace").split()
    if words == ["ok"]:
        return None
    if len(words) == 2 and words[0] in ("workdir", "script"):
        field = words[0]
        path = workdir if field == "workdir" else script
        shown = path if path is not None and os.path.isabs(path) else f"{workdir}/{path}"
        return PathProblem(field, _words(words[1], shown, who, field))
    return PathProblem("workdir" if workdir is not None else "script",
                       f"its paths could not be checked as {who} (the check exited {proc.returncode})")


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """End a helper that ran out of time, its group with it; reaped within KILL_WAIT, else by the reaper."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.communicate(timeout=KILL_WAIT)
    except subprocess.TimeoutExpired:  # stuck in the kernel (an unanswering mount): never waited for here
        disown(proc.pid)
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()
