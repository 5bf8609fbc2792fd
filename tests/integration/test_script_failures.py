"""Script failures read like the user's program: `sys.exit(3)` is "exit 3" and `ddpctl wait
--exit-code` exits 3; a raised error's root-cause traceback starts at the script's own frame
while the rank log keeps every frame; a script that destroys and re-inits its process group is
tracked (rank.rejoined), not failed. Real daemon, real ddpctl, unmodified scripts."""

from __future__ import annotations

import json

import anyio
import pytest

from ddpd.protocol import JobState
from ddpd.protocol.control import EventView

from ..conftest import JOB_TIMEOUT, DaemonProc, assert_nothing_left
from ..scripts.helpers import SCRIPTS
from .test_cli import ddpctl, err, out

pytestmark = pytest.mark.anyio


async def _events(d: DaemonProc, job_id: str) -> list[EventView]:
    async with d.client.events(job_id) as stream:
        return [e async for e in stream]


async def _rank_log(d: DaemonProc, job_id: str, rank: int) -> str:
    text = ""
    async with d.client.logs(job_id) as chunks:
        async for chunk in chunks:
            if chunk.rank == rank:
                text += chunk.text
    return text


async def test_sys_exit_3_is_exit_3_and_wait_exit_code_returns_it(daemon: DaemonProc) -> None:
    job_id = await daemon.client.submit(
        daemon.spec(script=[str(SCRIPTS / "fails.py"), "--rank", "1", "--exit-code", "3"], nproc=2))
    done = await ddpctl(daemon, "wait", "--exit-code", job_id)
    assert done.returncode == 3, err(done)
    assert "FAILED" in err(done) and "rank 1: exit 3" in err(done) and "SystemExit" not in err(done)
    plain = await ddpctl(daemon, "wait", job_id)  # without the flag: the documented exit code
    assert plain.returncode == 1, err(plain)

    status = await ddpctl(daemon, "status", "-o", "json", job_id)
    assert status.returncode == 0, err(status)
    cause = json.loads(out(status))["root_cause"]
    assert (cause["rank"], cause["exit_code"]) == (1, 3), cause
    assert "traceback" not in cause and "error" not in cause, cause
    with anyio.fail_after(JOB_TIMEOUT):
        view = await daemon.client.wait(job_id)
    assert view.state == JobState.FAILED
    assert_nothing_left([view])


async def test_a_raising_scripts_traceback_starts_at_its_own_frame(daemon: DaemonProc) -> None:
    script = str(SCRIPTS / "fails.py")
    job_id = await daemon.client.submit(daemon.spec(script=[script, "--rank", "1", "--raise"], nproc=2))
    done = await ddpctl(daemon, "wait", "--exit-code", job_id)
    assert done.returncode == 1, err(done)
    view = await daemon.client.status(job_id)
    cause = view.root_cause
    assert view.state == JobState.FAILED and cause is not None and cause.rank == 1, cause
    assert (cause.error, cause.message, cause.exit_code) == ("ValueError", "bad batch on rank 1", 1)
    assert cause.traceback is not None
    lines = cause.traceback.splitlines()
    assert lines[0] == "Traceback (most recent call last):" and lines[1].startswith(f'  File "{script}", line ')
    assert "in load_batch" in cause.traceback
    assert "ddpd" not in cause.traceback and "runpy" not in cause.traceback, cause.traceback

    log = await _rank_log(daemon, job_id, 1)  # the rank log keeps the whole traceback
    assert "bootstrap.py" in log and "script.py" in log and "runpy" in log and "in load_batch" in log, log
    assert_nothing_left([view])


async def test_a_script_that_destroys_and_reinits_its_group_then_trains_succeeds(daemon: DaemonProc) -> None:
    job = await daemon.run(daemon.spec(script=[str(SCRIPTS / "rejoin.py"), "--rounds", "2", "--steps", "5"],
                                       nproc=2))
    assert job.state == JobState.SUCCEEDED, (job.reason, job.root_cause)
    assert [r.step for r in job.ranks] == [5, 5]
    events = await _events(daemon, job.id)
    assert sorted(e.rank for e in events if e.kind == "rank.joined") == [0, 1]
    rejoined = sorted((e.rank, e.data["count"]) for e in events if e.kind == "rank.rejoined")
    assert rejoined == [(0, 1), (0, 2), (1, 1), (1, 2)], rejoined
    assert not [e for e in events if e.kind == "rank.protocol_error"]
    assert_nothing_left([job])
