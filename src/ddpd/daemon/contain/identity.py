"""Who a job runs as: the submitter's identity, the checks at the door, and how ranks take it on.

The uid comes from SO_PEERCRED on the control socket; everything else comes from the passwd and
group databases, never from the client: `Identity.of(uid)` looks up the passwd entry, the primary
gid and the supplementary groups (`os.getgrouplist`, what `initgroups` would set).

- A daemon running as root starts each rank as the submitter: `popen_kwargs(identity)` gives
  `subprocess.Popen` its `user=`, `group=`, `extra_groups=` and `umask=0o077`. A daemon that is not
  root cannot switch users, so it gets `{}` and `check_serves` lets only its own uid in.
- `job_environment` builds a rank's environment from what the submitter exported: HOME, USER,
  LOGNAME and SHELL from the passwd entry, the job's `--env` pairs on top, the daemon's reserved
  variables last (they always win). A submit that exported nothing (`environ` absent: an older
  client, a raw request) starts from `submitted_environment`: the passwd entry's variables and
  `SANE_PATH`, never the root daemon's own environment (its HOME, PATH, secrets); only the
  daemon's own user gets the daemon's environment.
- `check_interpreter` runs the job's interpreter as the submitter, with the job's environment, to
  prove it can `import torch, ddpd.worker` before the job is accepted.

`Identity.of` and `check_interpreter` block (database lookups, a child process): call them via
`anyio.to_thread.run_sync`. The rest is pure.
"""

from __future__ import annotations

import errno
import grp
import os
import pwd
import re
import selectors
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .reaper import spawned

SANE_PATH = "/usr/local/bin:/usr/bin:/bin"  # a submit without `environ`: what login(1) gives a user
RANK_UMASK = 0o077  # what ranks create is the submitter's alone unless they widen it themselves
INTERPRETER_CHECK = "import torch, ddpd.worker"
CHECK_OUTPUT_LIMIT = 4096  # bytes of the check's stderr kept for the reason


class UnknownUser(LookupError):
    """A uid with no passwd entry: the daemon cannot run anything as it."""


@dataclass(frozen=True)
class Identity:
    """A submitter as the system knows it (passwd and group databases)."""

    uid: int
    gid: int
    groups: tuple[int, ...]  # supplementary groups, the primary gid included, as initgroups sets them
    name: str
    home: str
    shell: str

    @classmethod
    def of(cls, uid: int) -> Identity:
        """The identity of `uid` (blocking: NSS may ask LDAP or sssd; call via anyio.to_thread)."""
        try:
            entry = pwd.getpwuid(uid)
        except KeyError:
            raise UnknownUser(f"uid {uid} has no passwd entry; ddpd runs jobs only as known users") from None
        groups = tuple(sorted(set(os.getgrouplist(entry.pw_name, entry.pw_gid))))
        return cls(
            uid=uid,
            gid=entry.pw_gid,
            groups=groups,
            name=entry.pw_name,
            home=entry.pw_dir,
            shell=entry.pw_shell or "/bin/sh",
        )

    def identity_env(self) -> dict[str, str]:
        """HOME, USER, LOGNAME and SHELL from the passwd entry (not from what the client sent)."""
        return {"HOME": self.home, "USER": self.name, "LOGNAME": self.name, "SHELL": self.shell}

    def group_names(self) -> list[str]:
        """The names of the supplementary groups, for messages (blocking, like `of`)."""
        names = []
        for gid in self.groups:
            try:
                names.append(grp.getgrgid(gid).gr_name)
            except KeyError:
                names.append(str(gid))
        return names


def popen_kwargs(identity: Identity, daemon_uid: int | None = None) -> dict[str, Any]:
    """Keyword arguments for `subprocess.Popen` that start the child as `identity`.

    Only a root daemon can switch users; any other daemon gets `{}` (it runs its own uid's jobs
    only, see `check_serves`). `daemon_uid` defaults to the effective uid of this process.
    """
    if (os.geteuid() if daemon_uid is None else daemon_uid) != 0:
        return {}
    return {
        "user": identity.uid,
        "group": identity.gid,
        "extra_groups": list(identity.groups),
        "umask": RANK_UMASK,
    }


def check_serves(daemon_uid: int, peer_uid: int, allow_root_jobs: bool) -> str | None:
    """Why a daemon running as `daemon_uid` will not take jobs from `peer_uid`, or None if it will."""
    if daemon_uid != 0 and peer_uid != daemon_uid:
        return (
            f"this ddpd runs as uid {daemon_uid} and serves that user only (a per-user daemon); "
            f"uid {peer_uid} needs its own daemon (systemctl --user start ddpd) or the system one"
        )
    if peer_uid == 0 and not allow_root_jobs:
        return "jobs of root (uid 0) are refused by this daemon's config (allow_root_jobs = false); submit as a user"
    return None


def admin_gid(group: str | None) -> int | None:
    """The gid of the config's admin group (blocking NSS lookup, like `Identity.of`); None if unset or unknown."""
    if not group:
        return None
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        return None


def may_see_detail(viewer: Identity, owner_uid: int, admin: int | None) -> bool:
    """Whether `viewer` may see a job's detail (spec, env, args, logs, events, stacks): its owner,
    root, or a member of the admin group. Everyone else sees that the job exists and nothing more.
    """
    return viewer.uid in (owner_uid, 0) or (admin is not None and admin in viewer.groups)


def job_environment(
    identity: Identity,
    exported: Mapping[str, str],
    extra: Mapping[str, str],
    reserved: Mapping[str, str],
) -> dict[str, str]:
    """A rank's environment: exported, then the passwd identity, then the job's pairs, then reserved."""
    env = dict(exported)
    env.update(identity.identity_env())
    env.update(extra)
    env.update(reserved)
    return env


def submitted_environment(identity: Identity, environ: Mapping[str, str] | None) -> dict[str, str]:
    """What the submitter exported: `environ`; without it, the passwd entry's variables and SANE_PATH
    (the daemon's own environment only for the daemon's own user: a per-user daemon, as before)."""
    if environ is not None:
        return dict(environ)
    if identity.uid == os.geteuid():
        return dict(os.environ)
    return {**identity.identity_env(), "PATH": SANE_PATH}


_MISSING = re.compile(r"No module named '([^']+)'")


def _start_check(identity: Identity, python: str, env: Mapping[str, str], daemon_uid: int | None,
                 place: Callable[[int], None] | None) -> subprocess.Popen[bytes]:
    """The check's process: plain Popen as the user, or (`place`: into a cgroup first) through the gate."""
    std: dict[str, Any] = {"stdin": subprocess.DEVNULL, "stdout": subprocess.DEVNULL, "stderr": subprocess.PIPE,
                           "process_group": 0}
    if place is None:
        return spawned(lambda: subprocess.Popen([python, "-c", INTERPRETER_CHECK], env=dict(env), cwd="/", **std,
                                                **popen_kwargs(identity, daemon_uid)))
    from .gate import spawn_gated  # the gate imports this module (Identity, RANK_UMASK)

    as_user = identity if popen_kwargs(identity, daemon_uid) else None
    return spawn_gated([python, "-c", INTERPRETER_CHECK], env, "/", as_user, place, register=spawned,
                       what="the interpreter check", **std)


def _start_refusal(python: str, who: str, exc: OSError) -> str:
    if isinstance(exc, FileNotFoundError) or exc.errno == errno.ENOENT:
        return f"python {python} does not exist (or a directory on its path is missing)"
    if isinstance(exc, PermissionError) or exc.errno == errno.EACCES:
        return (
            f"python {python} is not executable by {who}: it or a directory on its path (or its symlink's "
            "target) is closed to that user; use an interpreter the user can run"
        )
    return f"python {python} cannot be started as {who}: {exc.strerror or exc}"


_GATE_FAILED = re.compile(rb"^ddpd: cannot start .* \[Errno (\d+)\] ([^\n:]*)", re.MULTILINE)


def check_interpreter(
    identity: Identity, python: str, env: Mapping[str, str], timeout: float, daemon_uid: int | None = None,
    place: Callable[[int], None] | None = None,
) -> str | None:
    """Why `python` cannot run a rank as `identity`, or None when it imports torch and ddpd.worker.

    Runs `python -c "import torch, ddpd.worker"` as the user (`popen_kwargs`) with the job's `env`,
    in `/`, stdin from /dev/null, in a process group of its own that is killed afterwards, for at
    most `timeout` seconds, keeping only the tail of what it writes to stderr. With `place` (e.g. a
    cgroup's `add`), it starts through the gate and is placed before any of the user's code runs;
    the caller kills that cgroup afterwards (what the check left, even `setsid`, ends with it).
    Blocking (a child process and `import torch`, about 2 s): call via anyio.to_thread.
    """
    if not os.path.isabs(python):
        return f"python {python!r} must be an absolute path (ddpctl sends sys.executable or --python PATH)"
    who = f"user {identity.name} (uid {identity.uid})"
    try:
        proc = _start_check(identity, python, env, daemon_uid, place)
    except OSError as exc:
        return _start_refusal(python, who, exc)
    try:
        tail, exited = _tail_and_wait(proc, timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the leader is not reaped yet: its group id is still its own
        except ProcessLookupError:
            pass
        returncode = proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()
    if not exited:
        return f"python {python} did not finish `{INTERPRETER_CHECK}` within {timeout:g} s as {who}"
    if returncode == 0:
        return None
    gate = _GATE_FAILED.search(tail) if place is not None else None
    if gate is not None:  # the gate could not exec it (as the user)
        return _start_refusal(python, who, OSError(int(gate.group(1)), gate.group(2).decode(errors="replace")))
    err = tail.decode(errors="replace")
    missing = _MISSING.search(err)
    if missing:
        module = missing.group(1)
        hint = "pip install torch" if module.split(".")[0] == "torch" else "pip install ddpd"
        return (
            f"python {python} cannot import {module} as {who} (No module named '{module}'); "
            f"install it into that environment ({hint})"
        )
    last = err.strip().splitlines()[-1] if err.strip() else f"exit status {returncode}"
    return f"python {python} failed `{INTERPRETER_CHECK}` as {who}: {last}"


def _tail_and_wait(proc: subprocess.Popen[bytes], timeout: float) -> tuple[bytes, bool]:
    """The last CHECK_OUTPUT_LIMIT bytes of `proc`'s stderr, and whether it exited within `timeout` s.

    Reads as output comes, so a child that writes without end costs bounded memory and time. The
    exit is seen on a pidfd (a background child may hold stderr open after the interpreter is
    gone), without reaping, so the caller can still signal the child's group.
    """
    assert proc.stderr is not None
    deadline = time.monotonic() + timeout
    tail = b""
    err = proc.stderr.fileno()
    os.set_blocking(err, False)
    pidfd = os.pidfd_open(proc.pid)
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(err, selectors.EVENT_READ)
            sel.register(pidfd, selectors.EVENT_READ)
            reading = True
            while True:
                left = deadline - time.monotonic()
                ready = {key.fd for key, _ in sel.select(left)} if left > 0 else set()
                if not ready:
                    return tail, False
                if reading:
                    for _ in range(16):  # what is there now, bounded: a writer may never stop
                        try:
                            chunk = os.read(err, 65536)
                        except BlockingIOError:
                            break
                        if not chunk:
                            sel.unregister(err)
                            reading = False
                            break
                        tail = (tail + chunk)[-CHECK_OUTPUT_LIMIT:]
                if pidfd in ready:
                    return tail, True
    finally:
        os.close(pidfd)
