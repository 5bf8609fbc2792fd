"""`ddpctl stacks`: every thread of every rank of a running job, identical stacks grouped, the job
running on; owner or root only; nothing for a job that has ended."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from ddpd.client import ErrorCode, RemoteError
from ddpd.daemon.attempt.stacks import NO_PY_SPY, PY_SPY_WAIT, STACKS_WAIT, find_py_spy
from ddpd.protocol import JobState

from ..conftest import JOB_TIMEOUT, REPO, DaemonProc, assert_nothing_left, running_daemon
from ..scripts.helpers import SCRIPTS

pytestmark = pytest.mark.anyio

NOBODY = 65534


async def ddpctl(d: DaemonProc, *args: str, uid: int | None = None) -> subprocess.CompletedProcess[bytes]:
    """The real ddpctl; as another user through tests/scripts/as_user.py."""
    prefix = ["-m", "ddpd.cli"] if uid is None else ["-m", "tests.scripts.as_user", str(uid), str(uid), "--"]
    with anyio.fail_after(120):
        return await anyio.run_process([sys.executable, *prefix, "--socket", str(d.socket), *args], check=False,
                                       stdin=subprocess.DEVNULL, cwd=str(REPO),
                                       env={**os.environ, "HOME": "/tmp", "COLUMNS": "200"})


async def wait_at_gate(d: DaemonProc, job_id: str, ranks: int) -> None:
    """Every rank printed that it waits at the gate (a handshake on the logs, no sleep)."""
    seen: set[int] = set()
    with anyio.fail_after(JOB_TIMEOUT):
        async with d.client.logs(job_id, follow=True) as chunks:
            async for chunk in chunks:
                if "waiting at the gate" in chunk.text:
                    seen.add(chunk.rank)
                    if len(seen) == ranks:
                        return
    raise AssertionError(f"job {job_id} ended before {ranks} rank(s) reached the gate")


def _thread_states(pid: int) -> set[str]:
    states = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{task}/stat").read_text()
        except OSError:
            continue
        states.add(stat.rsplit(")", 1)[1].split()[0])
    return states


async def all_threads_stopped(pid: int) -> None:
    """Until every thread of `pid` shows state T in /proc (a signal is queued at once but acted on by
    each thread when it next runs: on a loaded machine a thread may answer one more frame first)."""
    with anyio.fail_after(30):
        while True:  # /proc has no event to wait on: a bounded poll of the observable state
            if await anyio.to_thread.run_sync(_thread_states, pid) == {"T"}:
                return
            await anyio.sleep(0.01)


def _open_to_everyone(base: Path) -> Path:
    """A config with a socket anyone may open (the daemon still checks who owns the job)."""
    base.chmod(0o755)  # nobody must reach the socket inside
    config = base / "ddpd.toml"
    config.write_text('socket_mode = "0666"\n')
    return config


async def test_stacks_of_a_running_script_grouped_and_the_job_runs_on(short_tmp: Path) -> None:
    config = _open_to_everyone(short_tmp)
    gate = short_tmp / "gate"
    async with running_daemon(short_tmp, "--config", str(config)) as d:
        spec = d.spec(script=[str(SCRIPTS / "train_steps.py"), "--steps", "3", "--gate", str(gate)], nproc=2)
        job_id = await d.client.submit(spec)
        await wait_at_gate(d, job_id, 2)

        result = await d.client.stacks(job_id)
        assert result.job_id == job_id and result.attempt == 1
        assert [(r.rank, r.answered) for r in result.ranks] == [(0, True), (1, True)], result.ranks
        main = [g for g in result.groups if g.main]
        assert len(main) == 1, main  # both ranks wait in the same place: one stack, shown once
        assert main[0].ranks == [0, 1] and main[0].thread == "MainThread"
        assert "in wait_at_gate" in main[0].stack and "train_steps.py" in main[0].stack
        assert "runpy" not in main[0].stack and "ddpd/worker/script.py" not in main[0].stack
        assert next(g for g in result.groups if g.thread == "ddpd-heartbeat").ranks == [0, 1]

        one = await d.client.stacks(job_id, rank=1)
        assert [r.rank for r in one.ranks] == [1] and all(g.ranks == [1] for g in one.groups)
        with pytest.raises(RemoteError) as missing:
            await d.client.stacks(job_id, rank=5)
        assert missing.value.code == ErrorCode.NOT_FOUND

        native = await d.client.stacks(job_id, native=True)
        if find_py_spy() is None:
            assert native.note == NO_PY_SPY and native.groups  # said so, and the Python stacks shown
        else:
            assert all(r.native for r in native.ranks), native.ranks

        shown = await ddpctl(d, "stacks", job_id)
        assert shown.returncode == 0, shown.stderr.decode()
        out = shown.stdout.decode()
        assert "== ranks 0-1 · thread MainThread ==" in out and "in wait_at_gate" in out, out
        assert "ddpd-heartbeat" not in out and "--all-threads" in shown.stderr.decode()  # ddpd's own: hidden
        shown = await ddpctl(d, "stacks", job_id, "--all-threads")
        assert "thread ddpd-heartbeat ==" in shown.stdout.decode()
        denied = await ddpctl(d, "stacks", job_id, uid=NOBODY)
        assert denied.returncode == 1 and b"permission_denied" in denied.stderr, denied.stderr

        # a rank that cannot answer (stopped here; a native call holding the GIL alike) is said so
        view = await d.client.status(job_id)
        stopped = view.ranks[1].pid
        assert stopped is not None
        os.kill(stopped, signal.SIGSTOP)
        await all_threads_stopped(stopped)  # the handshake: the stop is in effect before the daemon asks
        try:
            with anyio.fail_after(STACKS_WAIT + PY_SPY_WAIT + 10):
                silent = await d.client.stacks(job_id)
        finally:
            os.kill(stopped, signal.SIGCONT)
        assert [(r.rank, r.answered) for r in silent.ranks] == [(0, True), (1, False)], silent.ranks
        assert "no answer within" in (silent.ranks[1].note or "")
        assert all(g.ranks == [0] for g in silent.groups)

        view = await d.client.status(job_id)
        assert view.state == JobState.RUNNING and [r.state for r in view.ranks] == ["TRAINING", "TRAINING"]
        gate.touch()  # the job goes on from where it was asked
        with anyio.fail_after(JOB_TIMEOUT):
            job = await d.client.wait(job_id)
        assert job.state == JobState.SUCCEEDED, job.root_cause
        with pytest.raises(RemoteError) as ended:
            await d.client.stacks(job_id)
        assert ended.value.code == ErrorCode.NOT_RUNNABLE
    assert_nothing_left([job])
