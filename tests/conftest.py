"""Shared fixtures: a real daemon in a subprocess, and proof that nothing it started is left; two test
users made with useradd and a directory they can reach (tests/users.py)."""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.abc import Process

from ddpd.client import AsyncClient
from ddpd.daemon.contain.cgroups import Cgroup, probe
from ddpd.daemon.contain.identity import Identity
from ddpd.protocol import JobSpec
from ddpd.protocol.control import EventView, JobView

from .users import public_dir, two_users, user_python_for_tests

REPO = Path(__file__).resolve().parent.parent
DAEMON_START_TIMEOUT = 60
JOB_TIMEOUT = 120


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def assert_gone(pid: int) -> None:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return
    raise AssertionError(f"process {pid} is still there: {describe(pid)}")


def describe(pid: int) -> str:
    """What /proc says of a process (its state, parent and command line), for a failure message."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError as exc:
        return f"gone while looked at ({exc})"
    state, ppid = stat.rsplit(")", 1)[1].split()[:2]
    return f"state {state}, parent {ppid}, {cmdline.strip()!r}"


def assert_group_gone(pgid: int) -> None:
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)


def processes_with_env(key: str, values: set[str]) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            env = Path(f"/proc/{name}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for item in env:
            k, _, v = item.partition(b"=")
            if k == key.encode() and v.decode(errors="replace") in values:
                found.append(int(name))
    return found


def assert_nothing_left(jobs: list[JobView]) -> None:
    """Every rank process and process group of these jobs is gone, and no descendant carries their id."""
    for job in jobs:
        for rank in job.ranks:
            if rank.pid is not None:
                assert_gone(rank.pid)
            if rank.pgid is not None:
                assert_group_gone(rank.pgid)
    left = processes_with_env("DDPD_JOB_ID", {j.id for j in jobs})
    assert left == [], f"processes of jobs still alive: {left}"


@dataclass
class DaemonProc:
    socket: Path
    state_dir: Path
    proc: Process
    client: AsyncClient
    logs: list[dict[str, Any]] = field(default_factory=list)
    _changed: anyio.Event = field(default_factory=anyio.Event)
    pids_seen: set[int] = field(default_factory=set)

    def spec(self, **kw: Any) -> JobSpec:
        kw.setdefault("workdir", str(REPO))
        return JobSpec(**kw)

    async def run(self, spec: JobSpec, timeout: float = JOB_TIMEOUT) -> JobView:
        job_id = await self.client.submit(spec)
        with anyio.fail_after(timeout):
            return await self.client.wait(job_id)

    async def wait_event(
        self, job_id: str | None, match: Callable[[EventView], bool], timeout: float = JOB_TIMEOUT
    ) -> EventView:
        """Follow the daemon's event stream until an event matches (a handshake, never a sleep)."""
        with anyio.fail_after(timeout):
            async with self.client.events(job_id, follow=True) as stream:
                async for event in stream:
                    if match(event):
                        return event
        raise AssertionError(f"event stream of {job_id} ended without a match")

    async def wait_log(self, match: Callable[[dict[str, Any]], bool], timeout: float = 30) -> dict[str, Any]:
        with anyio.fail_after(timeout):
            seen = 0
            while True:
                for line in self.logs[seen:]:
                    if match(line):
                        return line
                seen = len(self.logs)
                await self._changed.wait()

    async def _pump(self) -> None:
        assert self.proc.stderr is not None
        buf = b""
        async for chunk in self.proc.stderr:
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                try:
                    self.logs.append(json.loads(line))
                except ValueError:
                    self.logs.append({"event": "raw", "text": line.decode(errors="replace")})
            self._changed.set()
            self._changed = anyio.Event()


def daemon_argv(socket_path: Path, state_dir: Path, *extra: str) -> list[str]:
    """No warm pool unless a test asks for one (a later flag wins), or DDPD_TEST_POOL_SIZE gives every
    daemon one (a tier run on pooled ranks: forked by default; tests that assert cold ranks then fail)."""
    pool = os.environ.get("DDPD_TEST_POOL_SIZE", "0")
    return [sys.executable, "-m", "ddpd.daemon", "serve", "--socket", str(socket_path),
            "--state-dir", str(state_dir), "--log-format", "json", "--allow-root-jobs",
            "--pool-size", pool, *extra]


async def start_daemon(
    tg: anyio.abc.TaskGroup, base: Path, *extra: str, env: dict[str, str] | None = None,
    state_dir: Path | None = None, prefix: tuple[str, ...] = (),
) -> DaemonProc:
    """`prefix`: a command the daemon runs under (`ip netns exec NS` for a node of its own)."""
    sock = base / "ddpd.sock"
    state = state_dir or base / "state"
    proc = await anyio.open_process(
        [*prefix, *daemon_argv(sock, state, *extra)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        env={**os.environ, **(env or {})}, cwd=str(REPO),
    )
    d = DaemonProc(socket=sock, state_dir=state, proc=proc, client=AsyncClient(sock))
    tg.start_soon(d._pump)
    tg.start_soon(_stop_when_abandoned, d)
    await d.wait_log(lambda e: e.get("event") == "daemon.ready", DAEMON_START_TIMEOUT)
    return d


async def _stop_when_abandoned(d: DaemonProc) -> None:
    """Ends when the daemon exits. If the test's task group is cancelled first (a failed assertion, a
    timeout), the daemon is stopped here: SIGTERM, then SIGKILL after a bounded wait, and reaped."""
    try:
        await d.proc.wait()
    finally:
        if d.proc.returncode is None:
            with anyio.CancelScope(shield=True):
                d.proc.send_signal(signal.SIGTERM)
                with anyio.move_on_after(30):
                    await d.proc.wait()
                if d.proc.returncode is None:
                    d.proc.kill()
                    await d.proc.wait()


async def stop_daemon(d: DaemonProc, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
    if d.proc.returncode is None:
        d.proc.send_signal(sig)
    with anyio.fail_after(timeout):
        return await d.proc.wait()


def assert_no_cgroup_left(state_dir: Path) -> None:
    """A daemon alone under the root cgroup (as here) removes its cgroup folder when it stops, and with
    it every attempt's, check's and agent's cgroup: none is left behind."""
    support = probe()
    if support.path is None or not support.usable:
        return
    instance = hashlib.sha256(str(state_dir.resolve()).encode()).hexdigest()[:12]
    left = support.path / f"ddpd-{instance}"
    if left.exists():
        inside = sorted(str(p.relative_to(left)) for p in left.rglob("*") if p.is_dir())
        raise AssertionError(f"the stopped daemon left its cgroup {left}, holding {inside}")


@pytest.fixture
def short_tmp() -> Any:
    """A short directory (Unix socket paths are limited to 108 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="ddpd-t"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@asynccontextmanager
async def running_daemon(base: Path, *flags: str, state_dir: Path | None = None,
                         env: dict[str, str] | None = None, prefix: tuple[str, ...] = ()) -> AsyncIterator[DaemonProc]:
    """A real daemon for the block; afterwards it is stopped (exit 0) and every process of every job
    is proven gone."""
    async with anyio.create_task_group() as tg:
        d = await start_daemon(tg, base, *flags, state_dir=state_dir, env=env, prefix=prefix)
        try:
            yield d
        finally:
            jobs: list[JobView] = []
            if d.proc.returncode is None:
                with anyio.fail_after(30):
                    jobs = await d.client.list_jobs()
            rc = await stop_daemon(d)
            assert rc == 0, f"daemon exited with {rc}"
            assert_nothing_left(jobs)
            assert_no_cgroup_left(d.state_dir)
            tg.cancel_scope.cancel()


@pytest.fixture
async def daemon(short_tmp: Path) -> AsyncIterator[DaemonProc]:
    async with running_daemon(short_tmp) as d:
        yield d


def _module_tag(request: pytest.FixtureRequest) -> str:
    """The test module's initials (test_trust_boundary: `tb`): names of its users and directories."""
    words = request.module.__name__.rpartition(".")[2].removeprefix("test_").split("_")
    return "".join(w[0] for w in words if w)


@pytest.fixture(scope="module")
def users(request: pytest.FixtureRequest) -> Iterator[tuple[Identity, Identity]]:
    """Two users made with useradd for the module (`ddpd<tag>a...`, `ddpd<tag>b...`), removed after it,
    who can run USER_PYTHON with this checkout (opened to them for the module)."""
    with user_python_for_tests(), two_users(f"ddpd{_module_tag(request)}") as pair:
        yield pair


@pytest.fixture(scope="module")
def plain_users(request: pytest.FixtureRequest) -> Iterator[tuple[Identity, Identity]]:
    """Two users made with useradd for the module, removed after it; the checkout stays as it is (a
    checkout closed to other users stays closed to them)."""
    with two_users(f"ddpd{_module_tag(request)}") as pair:
        yield pair


@pytest.fixture
def public_tmp(request: pytest.FixtureRequest) -> Iterator[Path]:
    """A short directory under /tmp every user can traverse (pytest's tmp_path is root's 0700): mode
    0755, or the mode of the closest `public_tmp` mark (`pytest.mark.public_tmp(0o1777)` where the
    users' processes write there)."""
    mark = request.node.get_closest_marker("public_tmp")
    mode = int(mark.args[0]) if mark is not None else 0o755
    with public_dir(f"ddpd-{_module_tag(request)}-", mode) as path:
        yield path


@pytest.fixture
def cgroup_base() -> Iterator[Path]:
    """A fresh cgroup under this process's own, removed (killed first) afterwards."""
    support = probe()
    if not support.usable or support.path is None:
        pytest.skip(f"cgroup v2 is not writable here: {support.reason}")
    base = support.path / f"ddpd-test-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    base.mkdir()
    try:
        yield base
    finally:
        for path in [*sorted((p for p in base.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)), base]:
            cg = Cgroup(path)
            assert cg.kill(30.0)
            cg.remove()


@pytest.fixture
def subreaper() -> Iterator[None]:
    """Orphans of the test's processes come to this process, so they can be reaped and proven gone."""
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    try:
        yield
    finally:
        libc.prctl(36, 0, 0, 0, 0)
