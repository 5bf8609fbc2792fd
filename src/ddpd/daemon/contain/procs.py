"""Processes: spawn into a process group, wait on pidfds, signal groups, and read /proc."""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import stat
import subprocess
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from .gate import spawn_gated
from .identity import RANK_UMASK, Identity
from .reaper import spawned

PR_SET_CHILD_SUBREAPER = 36


def set_child_subreaper() -> bool:
    """Make this process the reaper of orphaned descendants (so escaped grandchildren are found)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except OSError:
        return False


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"SIG{signum}"


@dataclass
class Exit:
    """How a process ended: an exit code, or the signal that killed it."""

    code: int | None
    signal: str | None

    @classmethod
    def from_returncode(cls, rc: int) -> Exit:
        return cls(None, signal_name(-rc)) if rc < 0 else cls(rc, None)

    @property
    def ok(self) -> bool:
        return self.code == 0

    def __str__(self) -> str:
        return f"signal {self.signal}" if self.signal else f"exit code {self.code}"


def open_log(log_path: Path) -> int:
    """A write fd (append) of a daemon-owned log: no symlink followed, no blocking, a regular file only."""
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                 0o644)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, f"{log_path} is not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _stay(pid: int) -> None:
    """No cgroup to enter: the gate only changes the user."""


def spawn(
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    cwd: str,
    log_fd: int,
    pass_fds: Sequence[int],
    process_group: int | None,
    identity: Identity | None = None,
    place: Callable[[int], None] | None = None,
    err_fd: int | None = None,
    umask: int = RANK_UMASK,
    what: str = "the process",
) -> subprocess.Popen[bytes]:
    """Start a fresh interpreter with stdin /dev/null, stdout to `log_fd` and stderr to `err_fd` (None:
    to `log_fd` too); the fds are the caller's to close.

    `process_group` None makes the child the leader of a session of its own (and of its process
    group: with autogroup scheduling a session is one CPU scheduling group, so each rank gets its own,
    as torchrun's workers do); 0 makes it the leader of a new group; a pgid joins that group. With an
    `identity` (a root daemon starting a user's rank) or a `place` (entering the attempt's cgroup),
    the child starts through the gate (`gate.spawn_gated`): placed, then as the user, then the
    working directory entered as that user, then `argv` exec'd; same pid throughout. Without
    either, it is started directly, as the daemon. OSError when the start fails. The child is
    registered (`reaper.spawned`): its owner reaps it, the reaper of inherited children never does.
    """
    err = subprocess.STDOUT if err_fd is None else err_fd
    group: dict[str, Any] = {"start_new_session": True} if process_group is None else {"process_group": process_group}
    if identity is not None or place is not None:
        return spawn_gated(argv, env, cwd, identity, place or _stay, umask=umask, register=spawned, what=what,
                           stdin=subprocess.DEVNULL, stdout=log_fd, stderr=err, pass_fds=tuple(pass_fds), **group)
    return spawned(lambda: subprocess.Popen(
        list(argv),
        stdin=subprocess.DEVNULL,
        stdout=log_fd,
        stderr=err,
        env=dict(env),
        cwd=cwd,
        pass_fds=tuple(pass_fds),
        close_fds=True,
        umask=umask,
        **group,
    ))


async def wait_exit(proc: subprocess.Popen[bytes]) -> Exit:
    """Wait for a child without polling: a pidfd becomes readable when it exits."""
    try:
        fd = os.pidfd_open(proc.pid)
    except ProcessLookupError:
        return Exit.from_returncode(proc.wait())
    try:
        while proc.poll() is None:
            await anyio.wait_readable(fd)
        assert proc.returncode is not None
        return Exit.from_returncode(proc.returncode)
    finally:
        os.close(fd)


async def wait_gone(pid: int) -> None:
    """Wait until a process that is not (necessarily) our child has exited."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        await anyio.wait_readable(fd)
    finally:
        os.close(fd)


def kill_group(pgid: int, signum: int) -> bool:
    """Signal a whole process group; False when the group no longer exists."""
    try:
        os.killpg(pgid, signum)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return False


@dataclass(frozen=True)
class ProcInfo:
    pid: int
    ppid: int
    pgid: int
    state: str
    start_time: int  # clock ticks since boot


def proc_info(pid: int) -> ProcInfo | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # the command name is in parentheses and may contain spaces: split after the last ')'
    rest = raw[raw.rindex(")") + 2 :].split()
    return ProcInfo(pid=pid, ppid=int(rest[1]), pgid=int(rest[2]), state=rest[0], start_time=int(rest[19]))


def proc_environ_has(pid: int, marker: bytes) -> bool:
    try:
        data = Path(f"/proc/{pid}/environ").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return False
    return marker in data.split(b"\0")


def all_pids() -> Iterable[int]:
    for name in os.listdir("/proc"):
        if name.isdigit():
            yield int(name)


def find_members(pgid: int | None, marker: bytes | None) -> list[ProcInfo]:
    """Processes in the group, or carrying the attempt's environment marker (escaped descendants)."""
    found: list[ProcInfo] = []
    me = os.getpid()
    for pid in all_pids():
        if pid == me:
            continue
        info = proc_info(pid)
        if info is None:
            continue
        if (pgid is not None and info.pgid == pgid) or (marker is not None and proc_environ_has(pid, marker)):
            found.append(info)
    return found


def reap_children(pids: Iterable[int]) -> list[int]:
    """Reap those of `pids` that are our exited children (orphans reparented to us, a subreaper).

    Only the pids given: a zombie of another attempt, or of the pool, is its owner's to wait for
    (reaped here, its owner's wait would get ECHILD and see exit code 0).
    """
    reaped: list[int] = []
    for pid in pids:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # not our child, or already reaped
            continue
        if done == pid:
            reaped.append(pid)
    return reaped
