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

`spawn_gated` blocks (fork, a pipe write): call via anyio.to_thread.
"""

from __future__ import annotations

import marshal
import os
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ddpd.daemon.contain.identity import RANK_UMASK, Identity

GATE_ABANDONED = 111  # the gate's exit status when the daemon gave up before the launch
GATE_EXEC_FAILED = 127

GATE_SOURCE = r"""
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
    os._exit(111)
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
    os.write(2, f"ddpd: cannot start {launch['argv'][0]} in {launch['cwd']}: {exc}\n".encode())
    os._exit(127)
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


def spawn_gated(
    argv: Sequence[str],
    env: Mapping[str, str],
    cwd: str,
    identity: Identity | None,
    place: Callable[[int], None],
    **popen: Any,
) -> subprocess.Popen[bytes]:
    """Start `argv` through the gate; `place(pid)` (e.g. `AttemptCgroup.add`) runs before it execs.

    `popen` goes to Popen (stdin, stdout, stderr, pass_fds, process_group...); `env`, `cwd`,
    `user`, `group`, `extra_groups` and `umask` are the gate's business and refused here. A root
    daemon passes the submitter's `identity`; a per-user daemon passes None. If `place` raises,
    the gate is abandoned (exits 111, having run nothing), reaped, and the error propagates.
    """
    refused = {"env", "cwd", "user", "group", "extra_groups", "umask", "preexec_fn", "executable"} & popen.keys()
    if refused:
        raise TypeError(f"spawn_gated sets {sorted(refused)} itself")
    document = launch_document(argv, env, cwd, identity)
    read_end, write_end = os.pipe()
    try:
        pass_fds = (*popen.pop("pass_fds", ()), read_end)
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", GATE_SOURCE, str(read_end)],
            env={},
            cwd="/",
            pass_fds=pass_fds,
            close_fds=True,
            **popen,
        )
    except BaseException:
        os.close(write_end)
        raise
    finally:
        os.close(read_end)
    try:
        place(proc.pid)
        with os.fdopen(write_end, "wb") as pipe:
            write_end = -1
            pipe.write(document)
    except BaseException:
        if write_end >= 0:
            os.close(write_end)
        proc.wait()
        raise
    return proc
