"""What every benchmark shares: the daemons, the launchers, /proc sampling and cleanup (the
statistics are in benchmarks/results.py).

Every process a benchmark starts carries ``DDPD_BENCH_TOKEN`` in its environment (set in this
process's environment, inherited by daemons, launchers, ranks and simulated workers), so the
final sweep finds and kills whatever is left, even after an error or Ctrl-C.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import msgspec

from ddpd.client import AsyncClient, RemoteError
from ddpd.protocol.control import Events, EventView, Item

REPO = Path(__file__).resolve().parent.parent
BENCH_DIR = Path(__file__).resolve().parent
PYTHON = sys.executable
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
DDP_SCRIPT = str(BENCH_DIR / "ddp_script.py")
SIMWORKER = str(BENCH_DIR / "simworker.sh")
TOKEN_ENV = "DDPD_BENCH_TOKEN"
CLK_TCK = os.sysconf("SC_CLK_TCK")
FINAL = frozenset({"SUCCEEDED", "FAILED", "CANCELLED", "TIMED_OUT"})

# Launcher names, in the order they alternate within one repetition.
DDPD = "ddpd"
DDPD_COLD = "ddpd (cold)"
TORCHRUN_NAME = "torchrun"
SPAWN = "mp.spawn"


class BenchError(RuntimeError):
    pass


def why(root_cause: Any) -> str:
    """A root cause in one line (its detail), without the traceback it carries."""
    if root_cause is None:
        return "no root cause"
    return f"{root_cause.reason}: {root_cause.detail or root_cause.message or ''}".strip()


# -- the run's token, scratch space and final sweep ---------------------------------------


def install_token() -> str:
    token = secrets.token_hex(8)
    os.environ[TOKEN_ENV] = token
    return token


def scratch_dir() -> Path:
    """A short directory (Unix socket paths are limited to 108 bytes)."""
    return Path(tempfile.mkdtemp(prefix="ddpdb-"))


def token_pids(token: str) -> list[int]:
    """Processes (other than this one) whose environment carries the run's token, and their
    descendants (a daemon's warm-pool interpreters start with an environment of their own: without
    them, a pooled daemon's refill went unseen and ran during the next measurement)."""
    needle = f"{TOKEN_ENV}={token}".encode()
    me = os.getpid()
    found: set[int] = set()
    parents: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        pid = int(name)
        try:
            env = Path(f"/proc/{name}/environ").read_bytes()
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        parents[pid] = int(stat[stat.rindex(")") + 2:].split()[1])
        if needle in env.split(b"\0"):
            found.add(pid)
    for pid in parents:
        seen, p = set(), parents.get(pid)
        while p is not None and p not in found and p not in seen and p > 1:
            seen.add(p)
            p = parents.get(p)
        if p in found:
            found.add(pid)
    return sorted(found)


def sweep(token: str) -> list[int]:
    """SIGKILL every process of this run still alive and reap our own children; returns their pids."""
    left = [pid for pid in token_pids(token) if proc_state(pid) not in (None, "Z")]
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(proc_state(p) not in (None, "Z") for p in left):
        time.sleep(0.01)
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
    return left


def cleanup_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


# -- /proc ------------------------------------------------------------------------------


def proc_state(pid: int) -> str | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rindex(")") + 2 :].split()[0]


def cpu_ticks(pid: int) -> int:
    """utime + stime of one process, in clock ticks."""
    raw = Path(f"/proc/{pid}/stat").read_text()
    rest = raw[raw.rindex(")") + 2 :].split()
    return int(rest[11]) + int(rest[12])


def rss_mib(pid: int, key: str = "VmRSS") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


@dataclass
class CpuSample:
    pid: int
    ticks: int
    at: float

    @classmethod
    def take(cls, pid: int) -> CpuSample:
        return cls(pid, cpu_ticks(pid), time.perf_counter())

    def percent_until(self, later: CpuSample) -> float:
        """CPU used between the two samples, in percent of one core."""
        return 100.0 * (later.ticks - self.ticks) / CLK_TCK / max(1e-9, later.at - self.at)


def tree_ticks(token: str) -> int:
    total = 0
    for pid in token_pids(token):
        try:
            total += cpu_ticks(pid)
        except (OSError, ValueError, IndexError):
            pass
    return total


async def settle(token: str, *, window: float = 0.5, below: float = 0.15, limit: float = 90.0) -> float:
    """Wait until this run's processes (daemons, pool workers) use less than `below` of a core.

    A warm pool refills itself after each job (`import torch` in new interpreters); the next
    measurement must not share the two cores with that. Returns the seconds waited.
    """
    start = time.perf_counter()
    while time.perf_counter() - start < limit:
        before = await anyio.to_thread.run_sync(tree_ticks, token)
        await anyio.sleep(window)
        after = await anyio.to_thread.run_sync(tree_ticks, token)
        if (after - before) / CLK_TCK / window < below:
            break
    return time.perf_counter() - start


async def wait_gone(pids: Sequence[int], timeout: float = 30.0) -> None:
    """Wait until none of `pids` exists any more (zombies count as existing until reaped)."""
    with anyio.fail_after(timeout):
        for pid in pids:
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                continue
            try:
                await anyio.wait_readable(fd)
            finally:
                os.close(fd)
        while any(_exists(pid) for pid in pids):  # noqa: ASYNC110 - exited, not yet reaped: no event for that
            await anyio.sleep(0.001)


async def wait_group_gone(pgid: int, timeout: float = 30.0) -> None:
    with anyio.fail_after(timeout):
        while True:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            except PermissionError:
                pass
            await anyio.sleep(0.001)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- the daemon -------------------------------------------------------------------------


@dataclass
class EventLog:
    """Every event of one daemon, each with the perf_counter time of its arrival here."""

    by_job: dict[str, list[tuple[float, EventView]]] = field(default_factory=lambda: defaultdict(list))
    changed: anyio.Event = field(default_factory=anyio.Event)
    error: BaseException | None = None

    def add(self, at: float, event: EventView) -> None:
        if event.job_id is not None:
            self.by_job[event.job_id].append((at, event))
        self.changed.set()
        self.changed = anyio.Event()

    async def wait(
        self, job_id: str, match: Callable[[EventView], bool], timeout: float = 300.0
    ) -> tuple[float, EventView]:
        """The first event of the job that matches (already seen or still to come), and its arrival."""
        seen = 0
        with anyio.fail_after(timeout):
            while True:
                if self.error is not None:
                    raise BenchError(f"event stream broke: {self.error!r}")
                events = self.by_job[job_id]
                for at, event in events[seen:]:
                    if match(event):
                        return at, event
                seen = len(events)
                await self.changed.wait()


def state_is(*states: str) -> Callable[[EventView], bool]:
    return lambda e: e.kind == "job.state_changed" and e.data.get("to") in states


@dataclass
class Daemon:
    name: str
    proc: subprocess.Popen[bytes]
    socket: Path
    state_dir: Path
    log_path: Path
    client: AsyncClient
    events: EventLog = field(default_factory=EventLog)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    async def follow_events(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Keep one follow-stream of all events open and record each event's arrival time."""
        conn = await self.client.open()
        try:
            await conn.send(Events(id=conn.next_id(), job_id=None, follow=True, since=0))
            task_status.started()
            while True:
                reply = await conn.receive()
                at = time.perf_counter()
                if not isinstance(reply, Item):
                    raise BenchError(f"{self.name}: event stream ended: {reply!r}")
                self.events.add(at, msgspec.convert(reply.item, EventView))
        except anyio.get_cancelled_exc_class():
            raise
        except BaseException as exc:
            self.events.error = exc
            self.events.changed.set()
            raise
        finally:
            await conn.aclose()


def write_config(path: Path, values: dict[str, Any]) -> None:
    def fmt(v: Any) -> str:
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, list | tuple):
            return "[" + ", ".join(fmt(x) for x in v) + "]"
        return str(v)

    path.write_text("".join(f"{k} = {fmt(v)}\n" for k, v in values.items()))


async def start_daemon(base: Path, name: str, *, config: dict[str, Any] | None = None,
                       flags: Sequence[str] = (), prefix: Sequence[str] = ()) -> Daemon:
    """A daemon in its own session (so Ctrl-C here does not reach it); ready when it answers a ping.
    `prefix`: a command it runs under (``ip netns exec NS`` for a node of its own)."""
    root = base / name.replace(" ", "-").replace("(", "").replace(")", "")
    root.mkdir(parents=True)
    sock, state, log_path, cfg = root / "s", root / "state", root / "daemon.log", root / "ddpd.toml"
    argv = [*prefix, PYTHON, "-m", "ddpd.daemon", "serve", "--socket", str(sock), "--state-dir", str(state),
            "--log-format", "json", "--allow-root-jobs", *flags]  # a private daemon: its runner's own jobs
    if config:
        write_config(cfg, config)
        argv += ["--config", str(cfg)]
    proc = _popen_logged(argv, log_path)
    d = Daemon(name, proc, sock, state, log_path, AsyncClient(sock))
    with anyio.fail_after(60):
        while True:
            if proc.poll() is not None:
                raise BenchError(f"daemon {name} exited with {proc.returncode}:\n{d.log_tail()}")
            try:
                await d.client.ping()
                return d
            except RemoteError:
                await anyio.sleep(0.05)


def _popen_logged(argv: Sequence[str], log_path: Path) -> subprocess.Popen[bytes]:
    with open(log_path, "ab") as log:
        return subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd=str(REPO),
                                start_new_session=True)


async def stop_daemon(d: Daemon, timeout: float = 60.0) -> int | None:
    if d.proc.poll() is None:
        d.proc.send_signal(signal.SIGTERM)
    with anyio.move_on_after(timeout):
        while d.proc.poll() is None:  # noqa: ASYNC110 - a Popen child: no awaitable exit
            await anyio.sleep(0.05)
    if d.proc.poll() is None:
        d.proc.kill()
        await anyio.to_thread.run_sync(d.proc.wait)
    return d.proc.returncode
