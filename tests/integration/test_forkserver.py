"""The fork server (``pool_fork_server = true``) against a real daemon and real torch.

A job's pooled ranks are forked by its key's server (``pool.forked`` names the server and the
rank's pid; the rank's parent is the daemon, it leads a session of its own), and each is the cold
rank it stands in for: the same job run on a daemon without a pool reports the same identity,
environment, ``sys.argv``, ``sys.path[0]``, ``__main__``, thread pools, descriptors and cgroup,
while its first random draws (Python's, numpy's, torch's) differ from every other rank's, as fresh
interpreters' do. Every wait is on a log line or a job's end, bounded with ``fail_after``; the
daemon's stop proves no rank, and no server, is left.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from ddpd.client import JobSpec
from ddpd.daemon.contain.identity import Identity
from ddpd.daemon.pool.channel import WorkerChannel
from ddpd.protocol import JobState
from ddpd.protocol.channel import Fork, ForkRefused, Hello
from ddpd.protocol.worker import worker_args

from ..conftest import REPO, DaemonProc, assert_gone, running_daemon, start_daemon, stop_daemon
from ..faults.helpers import await_gone, become_subreaper
from ..scripts.userpython import USER_PYTHON, user_pythonpath
from ..users import submit_as
from .test_hot_replace import STEP_SLEEP, checksums, events_of, kill_rank, same_run

pytestmark = pytest.mark.anyio

PROBE = str(REPO / "tests" / "integration" / "fork_probe.py")
SERVER_TIMEOUT = 240  # the server imports torch: seconds on a loaded 2-core machine
NPROC = 2


def probes(view: Any) -> list[dict[str, Any]]:
    """What each rank of a finished job reported, by rank."""
    found = []
    for r in sorted(view.ranks, key=lambda r: r.rank):
        lines = [line for line in Path(r.log).read_text().splitlines() if line.startswith("ddpd-fork-probe ")]
        assert len(lines) == 1, Path(r.log).read_text()
        found.append(json.loads(lines[0].split(" ", 1)[1]))
    return found


def as_any_rank(report: dict[str, Any], job_id: str, rank: int) -> dict[str, Any]:
    """What a rank reported, less what differs from one process or job to the next: its pid, parent,
    group, session, random draws, the job's ids and port in its environment, the daemon's instance
    in its cgroup's path, and rank 0's descriptors."""
    same = {k: v for k, v in report.items() if k not in ("pid", "ppid", "pgid", "sid", "random", "numpy", "torch",
                                                          "torch_seed")}
    same["environ"] = {k: v for k, v in report["environ"].items() if job_id not in v and k != "MASTER_PORT"}
    same["cgroup"] = re.sub(r"/ddpd-[0-9a-f]+/", "/DAEMON/", report["cgroup"].replace(job_id, "JOB"))
    same["rank"] = rank
    if rank == 0:  # it serves the attempt's store: its sockets come and go as the other ranks connect
        same.pop("fds", None)
    return same


async def run_probe(d: DaemonProc) -> tuple[str, list[dict[str, Any]], Any]:
    view = await d.run(d.spec(script=[PROBE], nproc=NPROC, name="probe"))
    assert view.state == JobState.SUCCEEDED, view.root_cause
    return view.id, probes(view), view


def forked_pids(d: DaemonProc) -> set[int]:
    return {int(e["pid"]) for e in d.logs if e.get("event") == "pool.forked"}


def spare_pids(d: DaemonProc) -> set[int]:
    """Workers forked ahead of a job (spares), whether a job took them since or not."""
    return {int(e["pid"]) for e in d.logs if e.get("event") == "pool.forked" and e.get("spare")}


def cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


def server_config(base: Path) -> Path:
    config = base / "ddpd.toml"
    config.write_text("pool_fork_server = true\n")
    return config


@pytest.fixture
async def cold_reports(short_tmp: Path) -> list[dict[str, Any]]:
    """The probe's job on a daemon without a pool: every rank a fresh interpreter."""
    base = short_tmp / "cold"
    base.mkdir()
    async with running_daemon(base, "--pool-size", "0", "--cpu-slots", "4") as d:
        job_id, seen, _ = await run_probe(d)
    return [as_any_rank(s, job_id, i) for i, s in enumerate(seen)]


@pytest.fixture
async def server_daemon(short_tmp: Path) -> AsyncIterator[tuple[DaemonProc, int]]:
    """A daemon whose pool is one fork server per key, and the pid of its own key's server (learned at
    start, when it said Hello); afterwards the server is gone too."""
    base = short_tmp / "fork"
    base.mkdir()
    async with running_daemon(base, "--config", str(server_config(base)), "--pool-size", "2",
                              "--cpu-slots", "4") as d:
        ready = await d.wait_log(lambda e: e.get("event") == "pool.worker_ready", SERVER_TIMEOUT)
        yield d, int(ready["pid"])
    for pid in [int(ready["pid"]), *forked_pids(d)]:  # the server, and every worker it forked (spares too)
        assert_gone(pid)


async def test_ranks_are_forked_by_the_keys_server_and_are_the_cold_ranks(
    cold_reports: list[dict[str, Any]], server_daemon: tuple[DaemonProc, int]
) -> None:
    d, server = server_daemon
    daemon_pid = d.proc.pid
    assert len(os.listdir(f"/proc/{server}/task")) == 1  # the server is single-threaded while it waits
    assert "--fork-server" in cmdline(server)
    draws: list[tuple[float, float | None, float, int]] = []
    used: set[int] = set()
    for n in range(2):
        if n == 1:  # the first job's size is learned: that many spares are forked ahead, for the next one
            await d.wait_log(lambda _, taken=frozenset(used): len(spare_pids(d) - taken) >= NPROC, SERVER_TIMEOUT)
        job_id, seen, view = await run_probe(d)
        pids = {r.pid for r in view.ranks if r.pid is not None}
        if n == 1:
            assert pids <= spare_pids(d), "the second job's ranks were not forked ahead of it"
        used |= pids
        forked = {int(e["pid"]): e for e in d.logs if e.get("event") == "pool.forked"}
        for i, (report, rank) in enumerate(zip(seen, sorted(view.ranks, key=lambda r: r.rank), strict=True)):
            assert report["pid"] == rank.pid and rank.pid in forked, "a rank was not forked by the server"
            assert int(forked[rank.pid]["server"]) == server
            assert report["ppid"] == daemon_pid  # reparented to the daemon, which reaped it
            assert report["pgid"] == report["sid"] == rank.pid  # a session and group of its own
            warm, cold = as_any_rank(report, job_id, i), cold_reports[i]
            assert warm == cold, {k: (warm.get(k), cold.get(k)) for k in {*warm, *cold} if warm.get(k) != cold.get(k)}
            draws.append((report["random"], report["numpy"], report["torch"], report["torch_seed"]))
        spawned = [e for e in [e async for e in d.client.events(job_id)] if e.kind == "rank.spawned"]
        assert [e.data.get("pooled") for e in spawned] == [True] * NPROC
    # every rank of both jobs drew differently, from each of its generators, as fresh interpreters do
    for column in zip(*draws, strict=True):
        assert len(set(column)) == len(column), column
    os.kill(server, 0)  # it served both jobs and still waits
    info = await d.client.daemon_info()
    said = re.fullmatch(r"warm \(1 fork server ready, (\d+) forked, (\d+) forks served\)", info.pool_state or "")
    assert said is not None and int(said.group(2)) >= 2 * NPROC, info.pool_state
    assert len(os.listdir(f"/proc/{server}/task")) == 1
    pids = [r.pid for r in view.ranks]
    for pid in pids:
        assert_gone(pid)


async def test_a_killed_rank_is_replaced_by_a_forked_one_back_to_back(server_daemon: tuple[DaemonProc, int]) -> None:
    """Hot replacement right after a job (no spare interpreter to wait for: the server forks it),
    with the uninterrupted run's checksum and the survivor kept."""
    d, server = server_daemon
    spec = d.spec(task="tests.tasks:slow", nproc=2, steps=400, seed=7, options={"step_sleep": STEP_SLEEP})
    reference = await d.run(spec)
    assert reference.state == JobState.SUCCEEDED, reference.root_cause
    job_id = await d.client.submit(spec)  # at once: back to back
    victim, survivors = await kill_rank(d, job_id, 1, after_step=100)
    with anyio.fail_after(120):
        job = await d.client.wait(job_id)
    assert job.state == JobState.SUCCEEDED, job.root_cause
    assert job.attempt == 1, "the job restarted instead of replacing the rank"
    assert same_run(job, reference), (checksums(job), checksums(reference))
    assert {r.rank: r.pid for r in job.ranks if r.rank != 1} == survivors, "a survivor was replaced"
    events = await events_of(d, job_id)
    [replaced] = [e for e in events if e.kind == "rank.replaced"]
    assert replaced.data["lost_pid"] == victim and replaced.data["pooled"] is True
    forked = {int(e["pid"]): int(e["server"]) for e in d.logs if e.get("event") == "pool.forked"}
    assert forked.get(job.ranks[1].pid) == server and forked.get(victim) == server
    print("rank.replaced", replaced.data)
    assert_gone(victim)


THREAD_AT_START = """
import threading
threading.Thread(target=threading.Event().wait, name="started-by-sitecustomize", daemon=True).start()
"""


async def test_back_to_back_jobs_of_a_new_key_go_through_its_server_while_it_starts(short_tmp: Path) -> None:
    """Bug: jobs submitted back to back from a daemon's start all started cold (12 two-rank jobs, each
    1.7 s: 12 `pool.refill_held`, no `pool.worker_ready`). The key's server, starting, was held (its
    cgroup frozen) while each job held the cores and thawed only in the moment between two jobs, so
    it never became ready. Now a server's start is never held, and a job's ranks wait for their key's
    server still starting (`pool.server_waiting`), at normal priority from then on, rather than
    start cold beside it.

    The key is new (an interpreter of its own: a wrapper) and its server waits for a gate file before
    it runs python; the gate opens once the first job's rank waits for it, while that job holds every
    core (`--cpu-slots 2`, two ranks). Every rank of that job and of the two submitted right after it
    is forked by that server."""
    base = short_tmp / "b2b"
    base.mkdir()
    gate = base / "gate"
    wrapper = base / "gated-python"
    wrapper.write_text(f'#!/bin/sh\ncase " $* " in *" --pool "*)\n  while [ ! -e {gate} ]; do sleep 0.05; done;;\n'
                       f'esac\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    config = base / "ddpd.toml"
    config.write_text("pool_fork_server = true\npool_server_wait = 240\n")  # (the server imports torch: CI is slow)
    async with running_daemon(base, "--config", str(config), "--pool-size", "2", "--cpu-slots", "2") as d:
        spec = d.spec(task="two-layer", nproc=NPROC, steps=5, python=str(wrapper))
        first = await d.client.submit(spec)
        # (the daemon's own key has a server too: this job waits only for its own key's)
        waiting = await d.wait_log(lambda e: e.get("event") == "pool.server_waiting", SERVER_TIMEOUT)
        server = int(waiting["server"])
        assert (waiting["job_id"], waiting["attempt"], waiting["rank"]) == (first, 1, 0), waiting  # bound as all
        assert os.sched_getscheduler(server) == os.SCHED_OTHER  # not at idle priority: the job waits for it
        gate.touch()
        with anyio.fail_after(SERVER_TIMEOUT):
            views = [await d.client.wait(first)]
        views += [await d.run(spec, timeout=SERVER_TIMEOUT) for _ in range(2)]
        assert [v.state for v in views] == [JobState.SUCCEEDED] * 3, [v.root_cause for v in views]
        forked = {int(e["pid"]): int(e["server"]) for e in d.logs if e.get("event") == "pool.forked"}
        assert [[forked.get(r.pid or 0) for r in v.ranks] for v in views] == [[server] * NPROC] * 3
        awaited = [e for e in d.logs if e.get("event") == "pool.server_awaited" and e.get("server") == server]
        assert awaited and all(e["ready"] for e in awaited), awaited
        taken = [e for e in d.logs if e.get("event") == "pool.forked" and not e.get("spare")]  # by a rank's start
        assert taken and all({"job_id", "attempt", "rank"} <= e.keys() for e in taken), taken
        assert not [e for e in d.logs if e.get("event") == "pool.refill_held" and e.get("pid") == server]
    assert_gone(server)


def log_text(path: str) -> str:
    return Path(path).read_text()


async def test_a_forked_task_rank_reads_its_own_channel_from_its_command_line(
    server_daemon: tuple[DaemonProc, int]
) -> None:
    """Bug: a forked rank's `sys.argv` was its server's, whose ``--fd`` names the server's channel (closed
    in the rank): a task that writes to its channel through it (the flood of the adversarial tier)
    died of EBADF on forked ranks. Now it names the rank's own channel, as a whole pooled
    interpreter's does, and ``--fork-server`` is gone."""
    d, server = server_daemon
    spec = d.spec(task="tests.adversarial.box_tasks:event_flood", nproc=1, steps=3,
                  options={"joins": 5, "checkpoints": 5})
    view = await d.run(spec, timeout=SERVER_TIMEOUT)
    assert view.state == JobState.SUCCEEDED, view.root_cause
    [rank] = view.ranks
    assert rank.pid in {int(e["pid"]) for e in d.logs if e.get("event") == "pool.forked"
                        and e.get("server") == server}
    assert "FLOODED" in log_text(rank.log)


def start_server(fd: int, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """A fork server whose parent is this process (the daemon's part, played by the test)."""
    return subprocess.Popen([sys.executable, "-m", "ddpd.worker", *worker_args(fd, os.getpid(), fork_server=True)],
                            pass_fds=[fd], start_new_session=True, env=env, stdin=subprocess.DEVNULL)


async def test_a_server_that_is_not_alone_refuses_to_fork(tmp_path: Path) -> None:
    """A thread in the server (here one an interpreter's sitecustomize starts) could hold a lock a
    forked child would inherit locked: the server answers ``fork_refused`` with its thread count,
    forks nothing, and still exits when its channel closes."""
    (tmp_path / "sitecustomize.py").write_text(THREAD_AT_START)
    ours, theirs = socket.socketpair()
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    proc = start_server(theirs.fileno(), env)
    theirs.close()
    try:
        channel = WorkerChannel(ours)
        with anyio.fail_after(SERVER_TIMEOUT):
            frames = channel.frames()
            hello = await anext(frames)
            assert isinstance(hello, Hello) and hello.pid == proc.pid
            child_end, kept = socket.socketpair()
            assert await channel.send(Fork(), fds=[kept.fileno()])
            kept.close()
            answer = await anext(frames)
            await frames.aclose()
        assert isinstance(answer, ForkRefused), answer
        assert answer.reason == "the fork server has 2 threads; it forks only alone"
        assert child_end.recv(1) == b""  # the server closed the refused channel's end: nothing forked
        child_end.close()
        channel.close()
        with anyio.fail_after(30):
            assert await anyio.to_thread.run_sync(proc.wait) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert_gone(proc.pid)


async def test_forked_ranks_and_their_server_die_with_the_daemon(short_tmp: Path) -> None:
    """A forked rank's death signal is set against the daemon once it is the daemon's child: the
    daemon killed with SIGKILL takes every forked rank and the server with it (the next daemon on
    the same state ends the job as a restart's and removes what the killed one left)."""
    become_subreaper()  # the killed daemon's orphans come here to be reaped (pid 1 here never reaps)
    state = short_tmp / "state"
    async with anyio.create_task_group() as tg:
        d = await start_daemon(tg, short_tmp, "--config", str(server_config(short_tmp)), "--pool-size", "2",
                               "--cpu-slots", "4", state_dir=state)
        ready = await d.wait_log(lambda e: e.get("event") == "pool.worker_ready", SERVER_TIMEOUT)
        server = int(ready["pid"])
        job_id = await d.client.submit(d.spec(task="tests.tasks:slow", nproc=NPROC, steps=10**6,
                                              options={"step_sleep": STEP_SLEEP}))
        await d.wait_event(job_id, lambda e: e.kind == "rank.progress")
        ranks = [r.pid for r in (await d.client.status(job_id)).ranks if r.pid is not None]
        assert len(ranks) == NPROC and set(ranks) <= forked_pids(d)
        await stop_daemon(d, signal.SIGKILL)
        tg.cancel_scope.cancel()
    for pid in {*forked_pids(d), server}:  # the ranks, the spares forked for the next job, the server
        await await_gone(pid, 10)
    async with running_daemon(short_tmp, "--pool-size", "0", state_dir=state) as d:
        with anyio.fail_after(60):
            view = await d.client.wait(job_id)
        assert view.reason == "daemon_restart"


def test_a_worker_already_reparented_does_not_wait_for_its_parent() -> None:
    """Bug: a forked worker whose intermediate parent had already exited (it was the daemon's child
    by the time it looked) waited on the daemon's pidfd, for good, instead of going on."""
    code = "import os; from ddpd.worker.forkserver import _await_reparent; _await_reparent(os.getppid())"
    done = subprocess.run([sys.executable, "-c", code], timeout=60, check=False, stdin=subprocess.DEVNULL)
    assert done.returncode == 0


SHOW = str(REPO / "tests" / "scripts" / "show_identity.py")


def identity_reports(view: Any) -> list[dict[str, Any]]:
    found = []
    for r in sorted(view.ranks, key=lambda r: r.rank):
        text = Path(r.log).read_text()
        found += [json.loads(line.split(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith("ddpd-test-identity ")]
    return found


@pytest.mark.xdist_group("users")  # useradd/userdel lock /etc/passwd: one worker at a time
@pytest.mark.skipif(os.geteuid() != 0, reason="running jobs as other users needs root")
async def test_a_users_ranks_are_forked_by_her_own_server_as_her(users: tuple[Identity, Identity],
                                                                  public_tmp: Path) -> None:
    """Her first job starts cold (a key new to the pool; ``pool_server_wait = 0``: beside its server,
    not through it) and her key's server starts as her; her next job's ranks are forked by it and
    are the cold ranks they stand in for (ids, groups, umask, environment, interpreter, directory,
    cgroup)."""
    ann, _ = users
    config = public_tmp / "ddpd.toml"
    config.write_text('socket_mode = "0666"\npool_fork_server = true\npool_server_wait = 0\n')
    async with running_daemon(public_tmp, "--config", str(config), "--gpus", "0", "--pool-size", "2",
                              "--cpu-slots", "4") as d:
        spec = JobSpec(script=[SHOW], python=USER_PYTHON, nproc=NPROC, workdir="/tmp",
                       environ={"PATH": "/usr/bin:/bin", "PYTHONPATH": user_pythonpath(), "MY_SETTING": "hello"})
        runs = []
        for n in range(2):
            job_id = await submit_as(ann, d, spec)
            assert not job_id.startswith("refused"), job_id
            with anyio.fail_after(SERVER_TIMEOUT):
                view = await d.client.wait(job_id)
            assert view.state == JobState.SUCCEEDED, view.root_cause
            runs.append((job_id, identity_reports(view), view))
            if n == 0:
                ready = await d.wait_log(lambda e: e.get("event") == "pool.worker_ready" and e.get("uid") == ann.uid,
                                         SERVER_TIMEOUT)
                server = int(ready["pid"])
                assert os.stat(f"/proc/{server}").st_uid == ann.uid
        (cold_id, cold, cold_view), (warm_id, warm, warm_view) = runs
        forked = {int(e["pid"]): int(e["server"]) for e in d.logs if e.get("event") == "pool.forked"}
        assert all(r.pid not in forked for r in cold_view.ranks)
        assert all(forked.get(r.pid or 0) == server for r in warm_view.ranks)
        assert len(cold) == len(warm) == NPROC
        for c, w in zip(cold, warm, strict=True):
            assert (w["uid"], w["gid"], w["groups"]) == (ann.uid, ann.gid, sorted(ann.groups))
            assert as_any_rank(w, warm_id, 0) == as_any_rank(c, cold_id, 0)
