"""The interpreter pool (``pool_fork_server = false``) against a real daemon (``--pool-size 2``) and
real torch: its own mechanics (the ranks are the interpreters that were ready, the pool refills with
new ones), so these daemons name that mode; the fork server, the default, is test_forkserver.py's.

Pool workers are identified by the daemon's log events (``pool.worker_ready`` / ``_taken`` /
``_spawned``; with fork servers ``pool.forked``); every wait is on a log line or a job event,
bounded with ``fail_after``. `ready`, `can_give` and `pool_can_give` hold in both modes: the other
tiers wait with them for a pool that gives a job's ranks without a cold start.
"""

from __future__ import annotations

import json
import os
import signal
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from ddpd.daemon.layout import stderr_log
from ddpd.protocol import JobState
from ddpd.protocol.control import EventView

from ..conftest import DaemonProc, assert_gone, assert_nothing_left, running_daemon

pytestmark = pytest.mark.anyio

POOL = 2
REFILL_TIMEOUT = 240  # a fresh interpreter imports torch: seconds on a loaded 2-core machine


def _pids(d: DaemonProc, event: str) -> set[int]:
    return {int(e["pid"]) for e in d.logs if e.get("event") == event and "pid" in e}


def _ready_pids(d: DaemonProc, server: bool) -> set[int]:
    return {int(e["pid"]) for e in d.logs
            if e.get("event") == "pool.worker_ready" and "pid" in e and bool(e.get("server")) == server}


def forking(d: DaemonProc) -> bool:
    """Whether the daemon's pool forks its ranks from fork servers (``pool_fork_server``, the default)."""
    return any(e.get("event") == "pool.started" and e.get("fork_server") for e in d.logs)


def servers_ready(d: DaemonProc) -> set[int]:
    """Fork servers ready now: said hello, neither retired nor dead."""
    return _ready_pids(d, server=True) - _pids(d, "pool.worker_retired") - _pids(d, "pool.worker_died")


def ready(d: DaemonProc) -> set[int]:
    """Pool workers that could be ranks now: interpreters that said hello, or with fork servers the
    spares forked ahead; neither taken nor dead."""
    spares = {int(e["pid"]) for e in d.logs if e.get("event") == "pool.forked" and e.get("spare")}
    gone = _pids(d, "pool.worker_taken") | _pids(d, "pool.worker_died") | _pids(d, "pool.spare_ended")
    return (_ready_pids(d, server=False) | spares) - gone


def can_give(d: DaemonProc, n: int) -> bool:
    """Whether the pool can give `n` ranks now without a cold start: `n` ready interpreters, or with
    fork servers a ready server (it forks any number of ranks in milliseconds, beside its spares)."""
    return bool(servers_ready(d)) if forking(d) else len(ready(d)) >= n


async def pool_can_give(d: DaemonProc, n: int) -> None:
    """Wait (on the daemon's log) until `can_give(d, n)`."""
    await d.wait_log(lambda _: can_give(d, n), REFILL_TIMEOUT)


def pool_pids_seen(d: DaemonProc) -> set[int]:
    """Every pool process the daemon's log names: interpreters, fork servers and the workers they forked."""
    pids = _pids(d, "pool.worker_spawned") | _pids(d, "pool.worker_ready") | _pids(d, "pool.forked")
    for e in d.logs:
        if e.get("event") == "pool.stopped":
            pids |= set(e.get("killed", []))
    return pids


async def pool_full(d: DaemonProc, exclude: frozenset[int] | set[int] = frozenset()) -> set[int]:
    """Wait (on the daemon's log) until POOL interpreters not in `exclude` are ready, or with fork
    servers until the pool can give POOL ranks (`can_give`); return the ready workers' pids."""
    await d.wait_log(lambda _: can_give(d, POOL) if forking(d) else len(ready(d) - exclude) >= POOL, REFILL_TIMEOUT)
    return ready(d) - exclude


async def _events(d: DaemonProc, job_id: str) -> list[EventView]:
    async with d.client.events(job_id) as stream:
        return [e async for e in stream]


@pytest.fixture
async def pool_daemon(short_tmp: Path) -> AsyncIterator[DaemonProc]:
    """A daemon with an interpreter pool; afterwards nothing of any job, and no pool worker, is left."""
    config = short_tmp / "ddpd.toml"
    config.write_text("pool_fork_server = false\n")
    async with running_daemon(short_tmp, "--config", str(config), "--pool-size", str(POOL), "--cpu-slots", "4") as d:
        yield d
    seen = pool_pids_seen(d)
    assert seen, "no pool worker was ever started"
    for pid in seen:
        assert_gone(pid)


async def test_two_layer_runs_on_pooled_workers_and_the_pool_refills(pool_daemon: DaemonProc) -> None:
    d = pool_daemon
    before = await pool_full(d)
    job = await d.run(d.spec(task="two-layer", nproc=2))
    assert job.state == JobState.SUCCEEDED, job.root_cause
    pids = {r.pid for r in job.ranks}
    assert pids == before, "the ranks are not the pool workers that were ready before the submit"
    assert [r.exit_code for r in job.ranks] == [0, 0]
    assert all(r.step == 20 for r in job.ranks)
    checksums = [r.checksum for r in job.ranks]
    assert checksums[0] is not None and checksums[0] == checksums[1]
    assert all(r.pgid == r.pid for r in job.ranks)  # each leads its own group (and session)
    events = await _events(d, job.id)
    assert [e.data.get("pooled") for e in events if e.kind == "rank.spawned"] == [True, True]
    assert [e.data.get("pooled") for e in events if e.kind == "rank.connected"] == [True, True]
    for r in job.ranks:  # the rank logs are where cold ranks' logs are
        assert r.log is not None and _is_file(r.log) and Path(r.log).parent.name == "attempt-1"
    # the pool refills with new interpreters; the used ones are gone for good
    refilled = await pool_full(d, exclude=before)
    assert not refilled & before
    for pid in before:
        assert_gone(pid)
    # and the next job takes the new ones
    job2 = await d.run(d.spec(task="two-layer", nproc=2, steps=3))
    assert job2.state == JobState.SUCCEEDED, job2.root_cause
    assert {r.pid for r in job2.ranks} == refilled


async def test_pooled_rank_killed_is_the_root_cause(pool_daemon: DaemonProc) -> None:
    d = pool_daemon
    before = await pool_full(d)
    spec = d.spec(task="tests.tasks:slow", nproc=2, steps=10_000, options={"step_sleep": 0.01},
                  hot_replace=0)  # a lost rank fails the attempt (test_hot_replace: replaced in place)
    job_id = await d.client.submit(spec)
    await d.wait_event(job_id, lambda e: e.kind == "rank.progress" and e.data["step"] >= 2)
    view = await d.client.status(job_id)
    pids = [r.pid for r in view.ranks]
    assert set(pids) == before
    assert all(p is not None and os.getpgid(p) == os.getsid(p) == p for p in pids), "a rank leads no session"
    victim = view.ranks[1].pid
    assert victim is not None
    os.kill(victim, signal.SIGKILL)
    with anyio.fail_after(60):
        job = await d.client.wait(job_id)
    assert job.state == JobState.FAILED
    rc = job.root_cause
    assert rc is not None and rc.rank == 1 and rc.signal == "SIGKILL", rc
    assert_nothing_left([job])


async def test_pooled_and_cold_ranks_mix_in_one_job(pool_daemon: DaemonProc) -> None:
    """Three ranks, two pool workers: rank 2 starts cold; each leads a session and group of its own."""
    d = pool_daemon
    before = await pool_full(d)
    spec = d.spec(task="tests.tasks:slow", nproc=3, steps=10_000, options={"step_sleep": 0.01})
    job_id = await d.client.submit(spec)
    await d.wait_event(job_id, lambda e: e.kind == "job.state_changed" and e.data.get("to") == "RUNNING",
                       timeout=120)
    view = await d.client.status(job_id)
    pids = [r.pid for r in view.ranks]
    assert set(pids[:2]) == before and pids[2] not in before
    assert all(p is not None and os.getpgid(p) == os.getsid(p) == p for p in pids)
    await d.client.cancel(job_id)
    with anyio.fail_after(60):
        job = await d.client.wait(job_id)
    assert job.state == JobState.CANCELLED
    assert_nothing_left([job])


SCRIPT = textwrap.dedent("""
    import json, os, subprocess, sys
    import torch
    import torch.distributed as dist

    keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "DDPD_JOB_ID", "JOB_ONLY"]
    child = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('DDPD_ATTEMPT', ''))"],
                           capture_output=True, text=True, check=True).stdout.strip()
    print("ENV " + json.dumps({"env": {k: os.environ.get(k) for k in keys}, "cwd": os.getcwd(),
                               "pid": os.getpid(), "child_marker": child}), flush=True)
    dist.init_process_group("gloo")
    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    print(f"SUM {t.item()}", flush=True)
    print(f"ERR {dist.get_rank()}", file=sys.stderr, flush=True)
    dist.destroy_process_group()
""")


def _is_file(path: str) -> bool:
    return Path(path).is_file()


def _read(path: str) -> str:
    return Path(path).read_text()


def _script_env(log: str) -> dict[str, Any]:
    for line in _read(log).splitlines():
        if line.startswith("ENV "):
            return dict(json.loads(line[4:]))
    raise AssertionError(f"no ENV line in {log}")


async def test_script_job_on_the_pool_gets_torchrun_env(pool_daemon: DaemonProc, tmp_path: Path) -> None:
    d = pool_daemon
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    before = await pool_full(d)
    job = await d.run(d.spec(script=[str(script)], nproc=2, workdir=str(tmp_path), env={"JOB_ONLY": "yes"}))
    assert job.state == JobState.SUCCEEDED, job.root_cause
    assert {r.pid for r in job.ranks} == before
    for r in job.ranks:
        assert r.log is not None
        seen = _script_env(r.log)
        env = seen["env"]
        assert env["RANK"] == env["LOCAL_RANK"] == str(r.rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] == str(job.store_port)
        assert env["TORCHELASTIC_RUN_ID"] == env["DDPD_JOB_ID"] == job.id
        assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        assert env["JOB_ONLY"] == "yes"
        assert seen["cwd"] == str(tmp_path) and seen["pid"] == r.pid
        assert seen["child_marker"].startswith(f"{job.id}:1:"), "children do not inherit DDPD_ATTEMPT"
        assert "SUM 3.0" in _read(r.log)
        # a pooled rank's stderr is kept apart from its stdout, as a cold rank's is
        assert "ERR" not in _read(r.log) and f"ERR {r.rank}" in _read(stderr_log(r.log))


async def test_job_setting_startup_variables_runs_cold(pool_daemon: DaemonProc) -> None:
    d = pool_daemon
    before = await pool_full(d)
    job = await d.run(d.spec(task="two-layer", nproc=2, steps=3, env={"PYTHONHASHSEED": "7"}))
    assert job.state == JobState.SUCCEEDED, job.root_cause
    assert not {r.pid for r in job.ranks} & before
    events = await _events(d, job.id)
    assert [e.data.get("pooled") for e in events if e.kind == "rank.spawned"] == [None, None]
    assert ready(d) == before
