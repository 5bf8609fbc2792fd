"""Script mode: unmodified torchrun scripts run as ddpd jobs, with torchrun's environment and
the daemon's store, while ddpd still sees each rank join and (optionally) report its steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from ddpd.client import RemoteError
from ddpd.protocol import JobState
from ddpd.protocol.control import EventView
from ddpd.protocol.spec import Timeouts

from ..conftest import JOB_TIMEOUT, REPO, DaemonProc, assert_nothing_left
from ..scripts.helpers import ENV_MARK, SCRIPTS, rank_reports

pytestmark = pytest.mark.anyio

# the torchrun beside the interpreter running the tests (the venv the suite runs in, wherever it is)
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
# set by torchrun's launcher for its own agent (which signals to forward), or by the terminal and
# locale handling of the process tree, not for the script
# TORCH_NCCL_ASYNC_ERROR_HANDLING: torchrun's 1 is not copied (torch's own default is safer)
LAUNCHER_ONLY = {"TORCHELASTIC_SIGNALS_TO_HANDLE", "LC_CTYPE", "COLUMNS", "LINES", "TORCH_NCCL_ASYNC_ERROR_HANDLING"}


async def _events(d: DaemonProc, job_id: str) -> list[EventView]:
    async with d.client.events(job_id) as stream:
        return [e async for e in stream]


async def _torchrun_env(nproc: int) -> dict[int, dict[str, str]]:
    """What torchrun itself gives each rank of the same script (the reference for compatibility)."""
    with anyio.fail_after(120):
        done = await anyio.run_process(
            [TORCHRUN, "--standalone", f"--nproc-per-node={nproc}", str(SCRIPTS / "show_env.py")],
            check=False, stdin=subprocess.DEVNULL, cwd=str(REPO),
        )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    envs: dict[int, dict[str, str]] = {}
    for line in done.stdout.decode().splitlines():
        if line.startswith(ENV_MARK):
            env = json.loads(line[len(ENV_MARK):])["env"]
            envs[int(env["RANK"])] = env
    return envs


async def test_every_variable_torchrun_sets_is_set_and_ranks_join(daemon: DaemonProc) -> None:
    reference = await _torchrun_env(2)
    added = {k for env in reference.values() for k in env} - set(os.environ) - LAUNCHER_ONLY
    assert {"RANK", "LOCAL_RANK", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE"} <= added

    job = await daemon.run(daemon.spec(script=[str(SCRIPTS / "show_env.py"), "--exit-code", "0"], nproc=2))
    assert job.state == JobState.SUCCEEDED, job.root_cause
    seen = await rank_reports(daemon.client, job.id)
    assert sorted(seen) == [0, 1]
    for rank, report in seen.items():
        env: dict[str, Any] = report["env"]
        missing = added - set(env)
        assert not missing, f"rank {rank} lacks torchrun's {sorted(missing)}"
        same = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "TORCHELASTIC_USE_AGENT_STORE",
                "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS"]
        assert {k: env[k] for k in same} == {k: reference[rank][k] for k in same}
        # torchrun sets TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (ncclCommAbort, which can hang); ddpd leaves torch's default
        assert env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING") == os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
        # the store is the daemon's, and the run is the job
        assert env["MASTER_PORT"] == str(job.store_port)
        assert env["TORCHELASTIC_RUN_ID"] == job.id
        assert report["argv"] == [str(SCRIPTS / "show_env.py"), "--exit-code", "0"]
    events = await _events(daemon, job.id)
    assert {e.rank for e in events if e.kind == "rank.joined"} == {0, 1}
    assert [r.state for r in job.ranks] == ["EXITED", "EXITED"]
    assert_nothing_left([job])


async def test_tutorial_script_runs_unmodified_with_its_arguments(daemon: DaemonProc) -> None:
    script = [str(SCRIPTS / "ddp_tutorial.py"), "--epochs", "2", "--lr", "0.1", "--batch_size", "16"]
    job = await daemon.run(daemon.spec(script=script, nproc=2))
    assert job.state == JobState.SUCCEEDED, job.root_cause
    texts: dict[int, str] = {}
    async with daemon.client.logs(job.id) as chunks:
        async for chunk in chunks:
            texts[chunk.rank] = texts.get(chunk.rank, "") + chunk.text
    # 64 samples over 2 ranks in batches of 16: 2 steps per epoch; DDP keeps the replicas identical
    assert "Epoch 1 | Steps: 2" in texts[0] and "Epoch 1 | Steps: 2" in texts[1]
    checksums = {text.split("done checksum ")[1].split()[0] for text in texts.values()}
    assert len(checksums) == 1
    joined = {e.rank for e in await _events(daemon, job.id) if e.kind == "rank.joined"}
    assert joined == {0, 1}
    assert_nothing_left([job])


async def test_module_mode_runs_a_package_module(daemon: DaemonProc) -> None:
    spec = daemon.spec(script=["tests.scripts.ddp_tutorial", "--epochs", "1"], module=True, nproc=2)
    job = await daemon.run(spec)
    assert job.state == JobState.SUCCEEDED, job.root_cause
    assert_nothing_left([job])


async def test_optional_api_reports_steps_and_a_failing_script_is_the_root_cause(daemon: DaemonProc) -> None:
    ok = await daemon.client.submit(daemon.spec(script=[str(SCRIPTS / "show_env.py"), "--steps", "5"], nproc=2))
    bad = await daemon.client.submit(
        daemon.spec(script=[str(SCRIPTS / "show_env.py"), "--steps", "1", "--exit-code", "3"], nproc=1))
    with anyio.fail_after(120):
        ok_view, bad_view = await daemon.client.wait(ok), await daemon.client.wait(bad)
    assert ok_view.state == JobState.SUCCEEDED, ok_view.root_cause
    assert [(r.step, r.loss) for r in ok_view.ranks] == [(5, 0.2), (5, 0.2)]
    events = await _events(daemon, ok)
    training = [e.rank for e in events if e.kind == "rank.state_changed" and e.data["to"] == "TRAINING"]
    assert sorted(training) == [0, 1]
    assert bad_view.state == JobState.FAILED
    assert bad_view.root_cause is not None and bad_view.root_cause.exit_code == 3
    assert bad_view.root_cause.rank == 0
    assert_nothing_left([ok_view, bad_view])


async def test_a_script_that_never_joins_and_exits_0_succeeds(daemon: DaemonProc) -> None:
    """Bug: a script that exited 0 without calling init_process_group ended FAILED internal_error
    (STARTING -> SUCCEEDED was not a legal transition); torchrun reports it as a success."""
    job = await daemon.run(daemon.spec(script=[str(SCRIPTS / "no_join.py")], nproc=2))
    assert job.state == JobState.SUCCEEDED, (job.reason, job.root_cause)
    assert [r.state for r in job.ranks] == ["EXITED", "EXITED"]
    assert [r.exit_code for r in job.ranks] == [0, 0]
    events = await _events(daemon, job.id)
    assert not [e for e in events if e.kind == "rank.joined"]
    assert_nothing_left([job])


async def test_the_daemons_variables_win_over_the_jobs_env(daemon: DaemonProc) -> None:
    """Bug: spec.env was applied after the daemon's own variables: a job could override its attempt
    marker (its setsid children then survived teardown) and CUDA_VISIBLE_DEVICES. Either the submit
    refuses the reserved names, or the ranks see the daemon's values."""
    forged = {"DDPD_ATTEMPT": "forged:1:0000", "CUDA_VISIBLE_DEVICES": "0,1", "RANK": "5", "MY_VAR": "kept"}
    spec = daemon.spec(script=[str(SCRIPTS / "no_join.py")], nproc=1, env=forged)
    refused: RemoteError | None = None
    try:
        job_id = await daemon.client.submit(spec)
    except RemoteError as exc:  # refused at the door, naming the key
        refused = exc
    if refused is not None:
        assert any(key in str(refused) for key in forged if key != "MY_VAR"), refused
        return
    with anyio.fail_after(JOB_TIMEOUT):
        job = await daemon.client.wait(job_id)
    assert job.state == JobState.SUCCEEDED, job.root_cause
    env: dict[str, str] = (await rank_reports(daemon.client, job.id))[0]["env"]
    assert env["DDPD_ATTEMPT"].startswith(f"{job.id}:1:")
    assert env["CUDA_VISIBLE_DEVICES"] == ""  # a CPU job sees no GPU
    assert env["RANK"] == "0"
    assert env["MY_VAR"] == "kept"
    assert_nothing_left([job])


async def _log_text(d: DaemonProc, job_id: str) -> dict[int, str]:
    texts: dict[int, str] = {}
    async with d.client.logs(job_id) as chunks:
        async for chunk in chunks:
            texts[chunk.rank] = texts.get(chunk.rank, "") + chunk.text
    return texts


async def test_nothing_a_script_leaves_is_freed_before_the_rank_leaves(daemon: DaemonProc) -> None:
    """Bug: the rank dropped the script's globals when it returned (runpy's module dict), so its DDP
    model was freed after destroy_process_group: gloo's destructor ran under the GIL while a gloo
    thread waited for the GIL, and about one pooled run in five hung at exit (heartbeat_timeout).
    Whether the script destroys its group, leaves it, or calls sys.exit(0) mid-script, nothing it
    left is freed before os._exit (no finalizer prints)."""
    ends = ("destroy", "exit", "leave")
    ids = [await daemon.client.submit(daemon.spec(script=[str(SCRIPTS / "leaves_alive.py"), "--end", end], nproc=2))
           for end in ends]
    with anyio.fail_after(JOB_TIMEOUT):
        jobs = [await daemon.client.wait(job_id) for job_id in ids]
    for end, job in zip(ends, jobs, strict=True):
        assert job.state == JobState.SUCCEEDED, (end, job.root_cause)
        texts = await _log_text(daemon, job.id)
        for rank in (0, 1):
            assert "trained 3 steps" in texts[rank], (end, texts[rank][-2000:])
            assert "freed" not in texts[rank], (end, texts[rank][-2000:])
    assert_nothing_left(jobs)


async def test_a_rank_stuck_after_its_script_is_named_stuck_at_exit(daemon: DaemonProc) -> None:
    """A rank that finished its script and then holds the GIL on its way out (its heartbeat thread
    starved) is reported as such, with the frame it is stuck in, not as a silent rank at work; it
    alone is ended, and its result stands (the script did succeed)."""
    spec = daemon.spec(script=[str(SCRIPTS / "stuck_at_exit.py")], nproc=1, timeouts=Timeouts(heartbeat=3.0))
    job = await daemon.run(spec)
    assert job.state == JobState.SUCCEEDED, job.root_cause
    stuck = [e for e in await _events(daemon, job.id) if e.kind == "rank.stuck_at_exit"]
    assert len(stuck) == 1, stuck
    message = str(stuck[0].data.get("message"))
    assert message.startswith("rank 0 finished its script and was stuck at exit in "), message
    assert "stuck_at_exit.py" in message and message.endswith("; ended (its result is kept)"), message
    assert_nothing_left([job])
