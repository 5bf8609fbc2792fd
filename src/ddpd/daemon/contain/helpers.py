"""Helper processes: what the daemon starts beside ranks (pool interpreters, interpreter checks,
notification hooks, rendezvous agents), their cgroups and their end, written once.

A `HelperKind` names a kind of helper: how its cgroups are named under the subtree's jobs
(``pool-<n>``, ``check-<uid>-<n>``, ``notify-<uid>-<n>``, ``<job>-rdzv``), the prefix of its log
events, and how long its cgroup may take to empty once killed. With it:

- `create` a cgroup of its own for one helper (`acreate`: from the event loop, None where there
  is no subtree or the cgroup cannot be made: the helper then runs in its process group only);
- `end` a helper's cgroup: kill what is left in it (a forked escapee, a `setsid` grandchild) and
  remove it; a cgroup that does not empty is logged (``<event>.cgroup_left``) and kept;
- `sweep` at the daemon's start the cgroups of its kind that a killed daemon left behind.

`run_bounded` runs one short helper to its end (blocking): started as the user (through the gate
`gate.spawn_gated` when it is placed into a cgroup first, before any of the user's code runs),
registered with the reaper (`reaper.spawned`: only its own `wait()` reaps it, so its exit status
is its own), in a process group of its own, stdin /dev/null, its stdout and stderr read as they
come and only their tails kept (a writer that never stops costs bounded memory and time), cut off
at its bound, its group killed and the leader reaped. `run_contained` runs such a helper from the
event loop in a cgroup of its own. `close` ends a long-lived helper (kill its group, reap it within a
bound, end its cgroup), as anyio's `Process.aclose` ends a process.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import structlog

from .cgroups import Cgroup, Subtree
from .gate import spawn_gated
from .identity import Identity, popen_kwargs
from .procs import wait_exit
from .reaper import spawned

log = structlog.get_logger("ddpd")

T = TypeVar("T")
Place = Callable[[int], None]  # puts a started helper's pid into its cgroup, before the helper execs
CLOSE_WAIT = 5.0  # seconds `close` waits for a killed helper's exit


@dataclass(frozen=True)
class HelperKind:
    """A kind of helper process: its cgroups' names (`prefix` + tag + `suffix`), its log events'
    prefix (`event`) and the seconds its cgroup may take to empty once killed (`kill_wait`)."""

    event: str
    prefix: str = ""
    suffix: str = ""
    kill_wait: float = 10.0

    def name(self, tag: str) -> str:
        return f"{self.prefix}{tag}{self.suffix}"

    def create(self, jobs: Path, tag: str) -> Cgroup:
        """A cgroup of its own for one helper under `jobs` (blocking); OSError if it cannot be made."""
        return Cgroup.create(jobs, self.name(tag))

    async def acreate(self, subtree: Subtree | None, tag: str, **facts: Any) -> Cgroup | None:
        """`create` from the event loop: None without a subtree, or (logged) when it cannot be made."""
        if subtree is None:
            return None
        try:
            return await anyio.to_thread.run_sync(self.create, subtree.jobs, tag)
        except OSError as exc:  # the helper still runs, in its process group only
            log.warning(f"{self.event}.cgroup_unavailable", error=str(exc), **facts)
            return None

    def end(self, cgroup: Cgroup) -> bool:
        """Kill what is left in a helper's cgroup and remove it (blocking); a stuck one is logged and
        kept. True if it is gone."""
        try:
            if cgroup.kill(self.kill_wait):
                cgroup.remove()
                return True
        except OSError as exc:
            log.warning(f"{self.event}.cgroup_left", cgroup=str(cgroup.path), error=str(exc))
            return False
        log.warning(f"{self.event}.cgroup_left", cgroup=str(cgroup.path), error="still populated after kill",
                    pids=_pids(cgroup))
        return False

    async def aend(self, cgroup: Cgroup | None) -> None:
        """`end` from the event loop, shielded: a cancelled caller still ends its helper's cgroup."""
        if cgroup is not None:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self.end, cgroup)

    def sweep(self, jobs: Path) -> int:
        """End the cgroups of this kind a killed daemon left under `jobs` (blocking); how many were
        found. A folder that cannot be listed (descriptors exhausted, say) is logged: the daemon
        goes on, and the next start sweeps again."""
        try:
            left = [path for path in jobs.glob(self.name("*")) if path.is_dir()]
        except OSError as exc:
            log.warning(f"{self.event}.sweep_failed", cgroup=str(jobs), error=str(exc))
            return 0
        for path in left:
            self.end(Cgroup(path))
        return len(left)


def _pids(cgroup: Cgroup) -> list[int]:
    try:
        return cgroup.pids()
    except OSError:
        return []


@dataclass(frozen=True)
class HelperRun:
    """How a bounded helper ended: its return code as its own `wait()` saw it (None: cut off at its
    bound), and the tails of what it wrote to stdout and stderr."""

    returncode: int | None
    stdout: bytes
    stderr: bytes


def start(argv: Sequence[str], env: Mapping[str, str], identity: Identity, place: Place | None,
          *, what: str, daemon_uid: int | None = None, **std: Any) -> subprocess.Popen[bytes]:
    """`argv` as `identity` (a root daemon switches users; any other runs it as itself) in `/`, registered
    with the reaper: through the gate when `place` (e.g. a cgroup's `add`) runs first, else straight."""
    kwargs = popen_kwargs(identity, daemon_uid)
    if place is None:
        return spawned(lambda: subprocess.Popen(list(argv), env=dict(env), cwd="/", **std, **kwargs))
    return spawn_gated(argv, env, "/", identity if kwargs else None, place, register=spawned, what=what, **std)


def run_bounded(argv: Sequence[str], env: Mapping[str, str], identity: Identity, timeout: float,
                place: Place | None, *, what: str, stdout_keep: int = 0, stderr_keep: int = 4096,
                daemon_uid: int | None = None) -> HelperRun:
    """Run one helper to its end, at most `timeout` s (blocking: call via anyio.to_thread); OSError
    when it cannot start. Its stdout is read only where `stdout_keep` > 0 (else /dev/null). Its
    group is killed afterwards (what it started there, and itself past the bound), the leader reaped."""
    pipes = {"stdout": subprocess.PIPE if stdout_keep > 0 else subprocess.DEVNULL, "stderr": subprocess.PIPE}
    proc = start(argv, env, identity, place, what=what, daemon_uid=daemon_uid, stdin=subprocess.DEVNULL,
                 process_group=0, **pipes)
    assert proc.stderr is not None
    out_fd, err_fd = (None if proc.stdout is None else proc.stdout.fileno()), proc.stderr.fileno()
    keep = {err_fd: stderr_keep} if out_fd is None else {out_fd: stdout_keep, err_fd: stderr_keep}
    try:
        tails, exited = _tails_and_wait(proc.pid, keep, timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the leader is not reaped yet: its group id is still its own
        except ProcessLookupError:
            pass
        returncode = proc.wait()
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
    return HelperRun(returncode if exited else None, b"" if out_fd is None else tails[out_fd], tails[err_fd])


def _tails_and_wait(pid: int, keep: dict[int, int], timeout: float) -> tuple[dict[int, bytes], bool]:
    """The last `keep[fd]` bytes read from each pipe, and whether `pid` exited within `timeout` s.

    Reads as output comes, bounded per wake-up (a writer may never stop). The exit is seen on a
    pidfd (a background child may hold a pipe open after the helper is gone), without reaping, so
    the caller can still signal the helper's group; what the pipes hold at the exit is read too."""
    deadline = time.monotonic() + timeout
    tails = dict.fromkeys(keep, b"")
    for fd in keep:
        os.set_blocking(fd, False)
    pidfd = os.pidfd_open(pid)
    try:
        with selectors.DefaultSelector() as sel:
            for fd in keep:
                sel.register(fd, selectors.EVENT_READ)
            sel.register(pidfd, selectors.EVENT_READ)
            while True:
                left = deadline - time.monotonic()
                ready = {key.fd for key, _ in sel.select(left)} if left > 0 else set()
                if not ready:
                    return tails, False
                for fd in [fd for fd in keep if fd in ready or pidfd in ready]:
                    if not _read_some(fd, keep[fd], tails):
                        sel.unregister(fd)
                        del keep[fd]
                if pidfd in ready:
                    return tails, True
    finally:
        os.close(pidfd)


def _read_some(fd: int, keep: int, tails: dict[int, bytes]) -> bool:
    """Read what `fd` holds now (16 reads at most) into its tail; False at its end."""
    for _ in range(16):
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return True
        if not chunk:
            return False
        tails[fd] = (tails[fd] + chunk)[-keep:]
    return True


async def run_contained(kind: HelperKind, subtree: Subtree | None, tag: str, run: Callable[[Place | None], T], *,
                        uid: int, limiter: anyio.CapacityLimiter | None = None,
                        abandon_on_cancel: bool = False) -> T:
    """`run(place)` (blocking, e.g. a `run_bounded` of its own) in a worker thread, its helper placed
    into a cgroup of its own (where there is a subtree; `place` None otherwise), that cgroup ended
    afterwards whatever happened (its end kills what an abandoned run left)."""
    cgroup = await kind.acreate(subtree, tag, uid=uid)
    try:
        return await anyio.to_thread.run_sync(run, None if cgroup is None else cgroup.add, limiter=limiter,
                                              abandon_on_cancel=abandon_on_cancel)
    finally:
        await kind.aend(cgroup)


async def close(kind: HelperKind, proc: subprocess.Popen[bytes], cgroup: Cgroup | None,
                wait: float = CLOSE_WAIT) -> None:
    """End a long-lived helper that leads its own process group: kill the group, reap it (at most
    `wait` s), end its cgroup; never raises for a helper already gone."""
    if proc.returncode is None:  # not reaped: its pid (and group) is still the helper's
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    with anyio.move_on_after(wait):
        await wait_exit(proc)
    await kind.aend(cgroup)
