"""Preemption with real ranks: a job of higher priority on a full box stops a preemptible one at an
agreed step; the preempted job checkpoints before its ranks exit, goes PREEMPTED -> QUEUED (who, at
which step), resumes from that checkpoint once the box is free, and ends with the same parameters
(checksum) as a run never interrupted. The preemption is repeated as often as fits in half a minute
(at least twice). A daemon restart while a preempted job checkpoints loses no job and runs none twice.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import anyio
import pytest

from ddpd.protocol import JobState
from ddpd.protocol.control import EventView, JobView

from ..conftest import DaemonProc, running_daemon
from ..scripts.helpers import state_is

pytestmark = pytest.mark.anyio

SLOW = "tests.tasks:slow"
STEPS = 800
ROUNDS = (2, 6)  # preemptions: at least, at most (as many as fit in BUDGET)
BUDGET = 30.0  # seconds for the rounds (the file stays within about two minutes)
# DDPD_PREEMPT_ROUNDS=50 (make soak-preempt): exactly that many preemptions, however long they take
EXACT_ROUNDS = int(os.environ.get("DDPD_PREEMPT_ROUNDS", "0"))
if EXACT_ROUNDS:
    STEPS = max(STEPS, 200 * EXACT_ROUNDS)  # room for every round's steps (each takes 30 to 60)

# an unmodified script that checkpoints on SIGUSR1 (as a Slurm job does with --signal), and resumes
SIGNALLED_SCRIPT = """
import signal, sys, torch
path, steps = sys.argv[1], int(sys.argv[2])
asked = []
signal.signal(signal.SIGUSR1, lambda signum, frame: asked.append(signum))
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
try:
    saved = torch.load(path)
    model.load_state_dict(saved["model"])
    start = saved["step"]
except FileNotFoundError:
    start = 0
print(f"starting at step {start}", flush=True)
x, y = torch.ones(8, 4), torch.zeros(8, 1)
for step in range(start + 1, steps + 1):
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    if asked:
        torch.save({"model": model.state_dict(), "step": step}, path)
        print(f"checkpointed at step {step}", flush=True)
        sys.exit(0)
    torch.cuda.synchronize() if torch.cuda.is_available() else __import__("time").sleep(0.01)
with open(path + ".done", "w") as f:
    f.write(f"{start} {steps}")
"""
TIMEOUT = 120


def low(d: DaemonProc, step_sleep: float) -> object:
    return d.spec(task=SLOW, nproc=2, steps=STEPS, seed=7, priority=-1, preemptible=True,
                  options={"step_sleep": step_sleep}, timeouts={"kill_grace": 30.0})


async def events_of(d: DaemonProc, job_id: str) -> list[EventView]:
    async with d.client.events(job_id) as stream:
        return [e async for e in stream]


def checksums(view: JobView) -> list[float | None]:
    return [r.checksum for r in view.ranks]


async def preempt_once(d: DaemonProc, job_id: str, attempt: int, after: int) -> int:
    """Preempt attempt `attempt` of the job once it trained past step `after`; the step it stopped at."""
    await d.wait_event(job_id, lambda e: e.kind == "rank.progress" and e.attempt == attempt
                       and e.data["step"] > after, TIMEOUT)
    urgent = await d.client.submit(d.spec(task="two-layer", nproc=2, steps=2, priority=10))
    preempted = await d.wait_event(job_id, lambda e: state_is("PREEMPTED")(e) and e.attempt == attempt, TIMEOUT)
    assert preempted.data["by"] == urgent and preempted.data["from"] == "RUNNING", preempted
    step = preempted.data["step"]
    mine = [e for e in await events_of(d, job_id) if e.attempt == attempt]
    asked = [e for e in mine if e.kind == "job.preempt_requested"]
    assert [(e.data["by"], e.data["by_priority"]) for e in asked] == [(urgent, 10)], asked
    saved = [e for e in mine if e.kind == "job.checkpointed"]
    exits = [e for e in mine if e.kind == "rank.exited"]
    assert [e.data["step"] for e in saved] == [step], saved  # the checkpoint is of the agreed step
    # rank 0 writes the checkpoint (rank 1 may leave first: it holds nothing rank 0 lacks); it left after
    assert sorted(e.rank for e in exits) == [0, 1] and all(e.data["exit_code"] == 0 for e in exits), exits
    assert next(e.seq for e in exits if e.rank == 0) > saved[0].seq, (saved, exits)
    assert not [e for e in mine if e.kind == "job.teardown"], "the ranks stopped unsignalled"
    requeued = next(e for e in await events_of(d, job_id) if state_is("QUEUED")(e) and e.seq > preempted.seq)
    assert (requeued.data["from"], requeued.data["by"], requeued.data["step"]) == ("PREEMPTED", urgent, step)
    with anyio.fail_after(TIMEOUT):
        assert (await d.client.wait(urgent)).state == JobState.SUCCEEDED
    return int(step)


async def test_a_higher_priority_job_preempts_and_the_preempted_one_resumes_from_its_checkpoint(
        short_tmp: Path) -> None:
    config = short_tmp / "ddpd.toml"
    config.write_text("preempt_min_run = 0\n")
    async with running_daemon(short_tmp, "--config", str(config), "--cpu-slots", "2", "--gpus", "0") as d:
        reference = await d.run(low(d, 0.0), TIMEOUT)  # never interrupted (no sleep: the same arithmetic)
        assert reference.state == JobState.SUCCEEDED, reference.root_cause
        job_id = await d.client.submit(low(d, 0.01))
        steps: list[int] = []
        deadline = time.monotonic() + BUDGET
        least, most = (EXACT_ROUNDS, EXACT_ROUNDS) if EXACT_ROUNDS else ROUNDS
        while len(steps) < least or (len(steps) < most and (EXACT_ROUNDS or time.monotonic() < deadline)):
            steps.append(await preempt_once(d, job_id, len(steps) + 1, steps[-1] + 10 if steps else 10))
            first = await d.wait_event(job_id, lambda e: e.kind == "rank.progress" and e.attempt == len(steps) + 1,
                                       TIMEOUT)
            assert first.data["step"] > steps[-1], (first, steps)  # resumed from the checkpoint, not from 0
        assert steps == sorted(steps) and len(set(steps)) == len(steps), steps
        with anyio.fail_after(TIMEOUT):
            done = await d.client.wait(job_id)
        assert done.state == JobState.SUCCEEDED and done.attempt == len(steps) + 1, done
        assert all(r.step == STEPS for r in done.ranks)
        assert checksums(done) == checksums(reference) and None not in checksums(done), (done.ranks, reference.ranks)


async def test_a_daemon_restart_while_a_preempted_job_checkpoints_loses_nothing_and_runs_nothing_twice(
        short_tmp: Path) -> None:
    config = short_tmp / "ddpd.toml"
    config.write_text("preempt_min_run = 0\n")
    flags = ("--config", str(config), "--cpu-slots", "2", "--gpus", "0")
    steps = 120
    async with running_daemon(short_tmp, *flags) as d:
        victim = await d.client.submit(d.spec(task=SLOW, nproc=2, steps=steps, seed=7, preemptible=True,
                                              options={"step_sleep": 0.05}, timeouts={"kill_grace": 30.0}))
        await d.wait_event(victim, lambda e: e.kind == "rank.progress" and e.data["step"] > 5, TIMEOUT)
        urgent = await d.client.submit(d.spec(task="two-layer", nproc=2, steps=2, priority=10))
        await d.wait_event(victim, lambda e: e.kind == "job.preempt_requested", TIMEOUT)
    # the daemon stopped (SIGTERM) while the ranks agreed on a step: the next one finds both queued
    async with running_daemon(short_tmp, *flags) as d:
        found = {v.id: v.state for v in await d.client.list_jobs()}
        assert found.keys() == {victim, urgent} and found[victim] == "QUEUED", found  # urgent may be starting
        first = await d.wait_event(victim, lambda e: e.kind == "rank.progress" and e.attempt == 2, TIMEOUT)
        with anyio.fail_after(TIMEOUT):
            done, other = await d.client.wait(victim), await d.client.wait(urgent)
        assert (done.state, done.attempt, other.state, other.attempt) == ("SUCCEEDED", 2, "SUCCEEDED", 1), (done, other)
        assert all(r.step == steps for r in done.ranks)
        events = await events_of(d, victim)
        preempted = [e for e in events if state_is("PREEMPTED")(e)]
        saved = [e.data["step"] for e in events if e.kind == "job.checkpointed" and e.attempt == 1]
        assert len(preempted) == 1 and saved == [preempted[0].data["step"]], (preempted, saved)
        assert first.data["step"] > saved[0], (first, saved)  # resumed from the checkpoint
        assert other.finished_at is not None and done.started_at is not None
        restarted = next(e for e in events if state_is("STARTING")(e) and e.attempt == 2)
        assert restarted.ts >= other.finished_at  # the job of higher priority ran first
        for job_id in (victim, urgent):
            assert [e.kind for e in await events_of(d, job_id)].count("job.finished") == 1


async def test_a_script_that_handles_the_stop_signal_checkpoints_when_preempted_and_resumes(
        short_tmp: Path) -> None:
    """Preemption of an unmodified script: the stop signal (SIGUSR1, the config's `stop_signal`) is raised
    in the rank whose script handles it, before any SIGTERM; it checkpoints and exits 0, and the next
    attempt resumes from that checkpoint."""
    config = short_tmp / "ddpd.toml"
    config.write_text("preempt_min_run = 0\n")
    script, saved = short_tmp / "signalled.py", short_tmp / "ckpt.pt"
    script.write_text(SIGNALLED_SCRIPT)
    async with running_daemon(short_tmp, "--config", str(config), "--cpu-slots", "1", "--gpus", "0") as d:
        job_id = await d.client.submit(d.spec(script=[str(script), str(saved), "100000"], nproc=1,
                                              workdir=str(short_tmp), priority=-1, preemptible=True,
                                              timeouts={"kill_grace": 30.0}))
        await d.wait_event(job_id, lambda e: e.kind == "rank.progress" and e.data["step"] > 5, TIMEOUT)
        urgent = await d.client.submit(d.spec(task="two-layer", nproc=1, steps=2, priority=10))
        preempted = await d.wait_event(job_id, state_is("PREEMPTED"), TIMEOUT)
        assert preempted.data["by"] == urgent
        mine = await events_of(d, job_id)
        asked = [e for e in mine if e.kind == "job.stop_requested"]
        assert [e.data.get("signal") for e in asked] == ["SIGUSR1"], asked
        exits = [e for e in mine if e.kind == "rank.exited"]
        assert [e.data["exit_code"] for e in exits] == [0], exits  # it left by itself, checkpointed
        assert not [e for e in mine if e.kind == "job.teardown"], "no SIGTERM was needed"
        with anyio.fail_after(TIMEOUT):
            assert (await d.client.wait(urgent)).state == JobState.SUCCEEDED
        # the next attempt resumes from the checkpoint: cancel it once it has trained past it
        await d.wait_event(job_id, lambda e: e.kind == "rank.progress" and e.attempt == 2, TIMEOUT)
        await d.client.cancel(job_id)
        with anyio.fail_after(TIMEOUT):
            done = await d.client.wait(job_id)
        assert done.attempt == 2 and done.state == JobState.CANCELLED, done
        first, second = _said(short_tmp / "state", job_id, 1), _said(short_tmp / "state", job_id, 2)
        checkpointed = [line for line in first if line.startswith("checkpointed at step ")]
        assert len(checkpointed) == 1 and first[0] == "starting at step 0", first
        assert second[0] == f"starting at step {checkpointed[0].split()[-1]}", (first, second)


def _said(state: Path, job_id: str, attempt: int) -> list[str]:
    """What rank 0 of the attempt printed (its stdout log in the owner's tree)."""
    logs = list(state.glob(f"users/*/jobs/{job_id}/attempt-{attempt}/rank-0.log"))
    assert len(logs) == 1, logs
    return logs[0].read_text().splitlines()

