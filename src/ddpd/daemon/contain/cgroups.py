"""Containment by cgroup v2: a cgroup per attempt or helper, ended with `cgroup.kill`, limits where delegated.

Where the daemon may write its own cgroup (systemd `Delegate=yes` on the unit; root on a host
whose cgroup2 mount is writable), it splits that cgroup once at start (`prepare_subtree`):

    <own>/daemon/        the daemon itself (and every process that was in <own>)
    <own>/jobs/          one child per attempt: <own>/jobs/<job>-a<n>/

The move comes first because of cgroup v2's "no internal processes" rule: a cgroup that hands
controllers to its children (`cgroup.subtree_control`) may not hold processes itself. Then the
wanted controllers (memory, cpu, pids) that `<own>` offers are enabled for `jobs` and for the
attempts below it; those it does not offer are reported as unavailable, never faked.

An attempt's ranks are put into its cgroup before any of their own code runs (see
`ddpd.daemon.contain.gate`), so whatever they fork, double-fork or setsid stays inside. Teardown
writes `1` to `cgroup.kill` (SIGKILL to every process in it, atomically against forks) and waits,
event-driven, for `populated 0` in `cgroup.events` (poll(2) wakes on a change of that file),
bounded: a process stuck in D state is reported, never allowed to wedge the daemon.

Everything here blocks on the file system: call via anyio.to_thread.
"""

from __future__ import annotations

import errno
import math
import os
import select
import time
from dataclasses import dataclass, field
from pathlib import Path

WANTED_CONTROLLERS = ("memory", "cpu", "pids")
CPU_PERIOD_US = 100_000
DAEMON_LEAF = "daemon"
JOBS_DIR = "jobs"


class CgroupError(OSError):
    """A cgroup operation that failed in a way the caller must report (busy, not permitted...)."""


def parse_mountinfo(text: str) -> Path | None:
    """The first cgroup2 mount point in /proc/self/mountinfo's text, or None."""
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        if sep and right.split(" ", 1)[0] == "cgroup2":
            fields = left.split(" ")
            if len(fields) >= 5:
                return Path(fields[4].replace("\\040", " "))
    return None


def parse_proc_cgroup(text: str) -> str | None:
    """The cgroup v2 path (the `0::` line) in /proc/<pid>/cgroup's text, or None."""
    for line in text.splitlines():
        if line.startswith("0::"):
            return line[3:] or "/"
    return None


def parse_keyed(text: str) -> dict[str, str]:
    """A flat-keyed cgroup file (`cgroup.events`, `memory.events`) as a dict."""
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key:
            out[key] = value.strip()
    return out


def cpu_max(cpus: float, period_us: int = CPU_PERIOD_US) -> str:
    """`cpu.max`'s text for a limit of `cpus` CPUs (e.g. 1.5 -> "150000 100000")."""
    if not math.isfinite(cpus) or cpus <= 0:
        raise ValueError(f"cpus must be a positive number, not {cpus!r}")
    return f"{max(1000, round(cpus * period_us))} {period_us}"


def own_cgroup(pid: int | str = "self") -> Path | None:
    """The cgroup v2 directory `pid` runs in, or None where there is no cgroup2 mount."""
    try:
        root = parse_mountinfo(Path("/proc/self/mountinfo").read_text())
        rel = parse_proc_cgroup(Path(f"/proc/{pid}/cgroup").read_text())
    except OSError:
        return None
    if root is None or rel is None:
        return None
    return root / rel.lstrip("/")


@dataclass(frozen=True)
class Support:
    """Whether the daemon can contain attempts by cgroup, and why not where it cannot."""

    path: Path | None
    usable: bool
    controllers: frozenset[str]
    reason: str | None = None


def probe(path: Path | None = None) -> Support:
    """Can the daemon create child cgroups of `path` (its own cgroup by default) and kill them?"""
    path = path if path is not None else own_cgroup()
    if path is None:
        return Support(None, False, frozenset(), "no cgroup v2 mount (cgroup2) on this host")
    try:
        controllers = frozenset(_read(path / "cgroup.controllers").split())
    except OSError as exc:
        return Support(path, False, frozenset(), f"{path} is not readable: {exc.strerror}")
    if not os.access(path, os.W_OK) or not os.access(path / "cgroup.procs", os.W_OK):
        return Support(path, False, controllers, f"{path} is not writable (the unit needs Delegate=yes)")
    probe_dir = path / f".ddpd-probe-{os.getpid()}"
    try:
        probe_dir.mkdir()
        has_kill = (probe_dir / "cgroup.kill").exists()
        probe_dir.rmdir()
    except OSError as exc:
        return Support(path, False, controllers, f"cannot create a cgroup under {path}: {exc.strerror}")
    if not has_kill:
        return Support(path, False, controllers, "this kernel has no cgroup.kill (Linux 5.14 or later needed)")
    return Support(path, True, controllers)


@dataclass(frozen=True)
class Subtree:
    """The daemon's split of its delegated cgroup: where attempts go and what they may be limited by."""

    base: Path
    jobs: Path
    controllers: frozenset[str]
    unavailable: dict[str, str] = field(default_factory=dict)


def prepare_subtree(base: Path, instance: str, wanted: tuple[str, ...] = WANTED_CONTROLLERS) -> Subtree:
    """Split `base` (the daemon's delegated cgroup) for attempts; idempotent across restarts.

    Normally: every process of `base` moves into `base/daemon`, attempts go under `base/jobs`, and
    the `wanted` controllers that `base` offers are enabled for them. When `base` is the root of the
    hierarchy (a daemon started outside any unit), nothing is moved (the root holds every process
    of the machine, and the no-internal-process rule does not bind it) and attempts go under
    `base/ddpd-<instance>` (`instance` names this daemon, e.g. a digest of its state directory),
    with only the controllers the root already hands down. A controller that cannot be had is
    reported in `Subtree.unavailable` with the reason.
    """
    if not (base / "cgroup.type").exists():  # only the root cgroup lacks it
        return _prepare_under_root(base, instance, wanted)
    leaf = base / DAEMON_LEAF
    jobs = base / JOBS_DIR
    leaf.mkdir(exist_ok=True)
    jobs.mkdir(exist_ok=True)
    for _ in range(100):  # processes may fork while being moved; each pass moves what is there
        pids = _pids(base)
        if not pids:
            break
        for pid in pids:
            _move(leaf, pid)
    return _enable(base, jobs, [base, jobs], wanted, f"is not delegated to {base} (cgroup.controllers)")


def _prepare_under_root(root: Path, instance: str, wanted: tuple[str, ...]) -> Subtree:
    if not instance or "/" in instance or instance in (".", ".."):
        raise ValueError(f"instance {instance!r} is not a single path component")
    jobs = root / f"ddpd-{instance}"
    jobs.mkdir(exist_ok=True)
    return _enable(root, jobs, [jobs], wanted, f"is not enabled at the root of {root} (cgroup.subtree_control)")


def _enable(base: Path, jobs: Path, targets: list[Path], wanted: tuple[str, ...], missing: str) -> Subtree:
    """Enable each wanted controller that `jobs` can get in the `targets`' subtree_control, in order."""
    offered = set(_read(targets[0] / "cgroup.controllers").split())
    enabled: set[str] = set()
    unavailable: dict[str, str] = {}
    for name in wanted:
        if name not in offered:
            unavailable[name] = f"controller {name} {missing}"
            continue
        try:
            for target in targets:
                _write(target / "cgroup.subtree_control", f"+{name}")
        except OSError as exc:
            unavailable[name] = f"controller {name} cannot be enabled under {base}: {exc.strerror}"
            continue
        enabled.add(name)
    return Subtree(base, jobs, frozenset(enabled), unavailable)


@dataclass(frozen=True)
class LimitReport:
    """What `Cgroup.set_limits` applied (file -> value) and what it could not (name -> why)."""

    applied: dict[str, str]
    unavailable: dict[str, str]


@dataclass(frozen=True)
class Cgroup:
    """A leaf cgroup (an attempt's, a rank's, a pool interpreter's, a helper process's): create, add,
    limit, kill, remove."""

    path: Path

    @classmethod
    def create(cls, parent: Path, name: str) -> Cgroup:  # also a rank leaf: create(attempt.path, "rank-0")
        """`parent/name`, created (an existing one, e.g. left by a crash, is reused: kill it first)."""
        if not name or "/" in name or name in (".", ".."):
            raise ValueError(f"cgroup name {name!r} is not a single path component")
        path = parent / name
        path.mkdir(exist_ok=True)
        return cls(path)

    def add(self, pid: int) -> None:
        """Move `pid` (its whole thread group) into this cgroup."""
        _move(self.path, pid)

    def pids(self) -> list[int]:
        return _pids(self.path)

    def populated(self) -> bool:
        return parse_keyed(_read(self.path / "cgroup.events")).get("populated") == "1"

    def set_limits(self, memory_bytes: int | None = None, cpus: float | None = None) -> LimitReport:
        """Apply `memory.max` and `cpu.max` where those controllers reach this cgroup."""
        wanted: dict[str, tuple[str, str]] = {}
        if memory_bytes is not None:
            if memory_bytes <= 0:
                raise ValueError(f"memory limit must be positive, not {memory_bytes}")
            wanted["memory"] = ("memory.max", str(memory_bytes))
        if cpus is not None:
            wanted["cpu"] = ("cpu.max", cpu_max(cpus))
        applied: dict[str, str] = {}
        unavailable: dict[str, str] = {}
        for controller, (filename, value) in wanted.items():
            target = self.path / filename
            if not target.exists():
                unavailable[controller] = (
                    f"controller {controller} is not delegated here ({filename} missing); limit not applied"
                )
                continue
            _write(target, value)
            applied[filename] = value
        return LimitReport(applied, unavailable)

    def kill(self, timeout: float) -> bool:
        """SIGKILL everything in the cgroup and wait up to `timeout` s for it to empty; True if it did."""
        if not self.path.exists():
            return True
        _write(self.path / "cgroup.kill", "1")
        return self.wait_empty(timeout)

    def wait_empty(self, timeout: float) -> bool:
        """Wait (poll(2) on cgroup.events, no polling loop) until `populated 0`; False on timeout."""
        deadline = time.monotonic() + timeout
        fd = os.open(self.path / "cgroup.events", os.O_RDONLY | os.O_CLOEXEC)
        try:
            poller = select.poll()
            poller.register(fd, select.POLLPRI | select.POLLERR)
            while True:
                text = os.pread(fd, 4096, 0).decode()
                if parse_keyed(text).get("populated") == "0":
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                poller.poll(max(1, math.ceil(left * 1000)))
        finally:
            os.close(fd)

    def take_over(self, source: Cgroup, timeout: float) -> bool:
        """Move every process of `source` (e.g. a pooled worker's cgroup) here, then end and remove `source`.

        A process forked during the move may stay behind: `source` is killed afterwards, so nothing
        escapes; True if `source` emptied within `timeout` s and was removed.
        """
        for _ in range(100):
            pids = source.pids()
            if not pids:
                break
            for pid in pids:
                self.add(pid)
        if not source.kill(timeout):
            return False
        source.remove()
        return True

    def remove(self) -> None:
        """Remove the (empty) cgroup and its child cgroups; CgroupError(EBUSY) while processes are left."""
        if not self.path.exists():
            return
        dirs = sorted((p for p in self.path.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts))
        for path in [*dirs, self.path]:
            try:
                path.rmdir()
            except FileNotFoundError:
                continue
            except OSError as exc:
                if exc.errno == errno.EBUSY:
                    raise CgroupError(exc.errno, f"{path} still has processes; not removed") from None
                raise


def _read(path: Path) -> str:
    with open(path) as f:
        return f.read()


def _write(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _pids(path: Path) -> list[int]:
    return [int(x) for x in _read(path / "cgroup.procs").split()]


def _move(path: Path, pid: int) -> None:
    try:
        _write(path / "cgroup.procs", str(pid))
    except ProcessLookupError:
        pass  # it exited meanwhile: nothing to contain
    except OSError as exc:
        raise CgroupError(exc.errno, f"cannot move pid {pid} into {path}: {exc.strerror}") from None


def remove_emptied(jobs: Path) -> list[Path]:
    """Remove the empty cgroups under `jobs` (blocking): those an unkillable rank's attempt kept,
    whose processes died after it ended. One still populated is left as it is. The ones removed."""
    removed = []
    for path in sorted(p for p in jobs.iterdir() if p.is_dir()) if jobs.is_dir() else []:
        try:
            Cgroup(path).remove()
        except OSError:  # still populated (EBUSY), or gone meanwhile
            continue
        removed.append(path)
    return removed

