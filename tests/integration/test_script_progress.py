"""Unmodified scripts get what tasks get: a step counter from their optimizer steps, the progress
timeout, and a hang diagnosis that names the rank behind and the script's own line."""

from __future__ import annotations

import re

import pytest

from ddpd.protocol import JobState
from ddpd.protocol.control import EventView

from ..conftest import DaemonProc, assert_nothing_left
from ..scripts.helpers import SCRIPTS

pytestmark = pytest.mark.anyio

TRAIN = str(SCRIPTS / "train_steps.py")
PROGRESS_TIMEOUT = 5.0
DIAGNOSIS_BOUND = 15.0  # stack dumps (bounded by 2 s), the teardown's grace and a loaded machine


async def _events(d: DaemonProc, job_id: str) -> list[EventView]:
    async with d.client.events(job_id) as stream:
        return [e async for e in stream]


async def _logs(d: DaemonProc, job_id: str) -> dict[int, str]:
    texts: dict[int, str] = {}
    async with d.client.logs(job_id) as chunks:
        async for chunk in chunks:
            texts[chunk.rank] = texts.get(chunk.rank, "") + chunk.text
    return texts


def _line_of(text: str) -> int:
    """The line of train_steps.py that holds `text`."""
    for number, line in enumerate((SCRIPTS / "train_steps.py").read_text().splitlines(), start=1):
        if text in line:
            return number
    raise AssertionError(text)


async def test_optimizer_steps_are_counted_without_code_changes(daemon: DaemonProc) -> None:
    job = await daemon.run(daemon.spec(script=[TRAIN, "--steps", "30"], nproc=2))
    assert job.state == JobState.SUCCEEDED, job.root_cause
    assert [r.step for r in job.ranks] == [30, 30]  # the hook's counter is the steps the script took
    texts = await _logs(daemon, job.id)
    assert all("took 30 optimizer steps" in texts[r] for r in (0, 1)), texts
    events = await _events(daemon, job.id)
    training = sorted(e.rank for e in events if e.kind == "rank.state_changed" and e.data["to"] == "TRAINING")
    assert training == [0, 1]
    assert_nothing_left([job])


async def test_an_unmodified_script_hung_in_a_collective_names_the_rank_behind(daemon: DaemonProc) -> None:
    """After 20 steps rank 1 reduces a metric no other rank reduces: it hangs one step behind, in its
    own `log_metric`, while rank 0 waits for it in DDP's gradient all-reduce."""
    trace = daemon.state_dir / "nccl-trace-rank-"  # as a GPU job gets it: the flight recorder asked for
    spec = daemon.spec(script=[TRAIN, "--steps", "20", "--hang-rank", "1"], nproc=2,
                       timeouts={"progress": PROGRESS_TIMEOUT, "kill_grace": 2.0},
                       env={"TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(trace)})
    job = await daemon.run(spec)
    job_id = job.id
    assert job.state == JobState.TIMED_OUT, job.root_cause
    rc = job.root_cause
    assert rc is not None and rc.reason == "progress_timeout", rc
    assert rc.rank == 1, rc
    detail = rc.detail or ""
    assert f"train_steps.py:{_line_of('dist.all_reduce(value, group=group)')} in log_metric" in detail, detail
    assert "rank 1 is behind: step 20, rank(s) [0] at 21" in detail, detail
    assert "rank(s) [0] wait for rank 1" in detail, detail
    assert "ddpd/worker" not in detail and "runpy" not in detail, detail
    assert [r.step for r in job.ranks] == [21, 20]
    # timed out within the progress timeout (counted from the last step, taken within a second of the
    # first) and a small bound
    events = await _events(daemon, job_id)
    training = max(e.ts for e in events if e.kind == "rank.state_changed" and e.data["to"] == "TRAINING")
    assert job.finished_at is not None
    assert job.finished_at - training < PROGRESS_TIMEOUT + DIAGNOSIS_BOUND
    # the rank logs hold both dumps; on gloo the flight recorder does not apply, and says so
    texts = await _logs(daemon, job_id)
    assert "in log_metric" in texts[1] and "Thread 0x" in texts[0]
    for text in texts.values():
        assert "flight recorder: does not apply to the gloo backend" in text, text[-3000:]
    assert not list(trace.parent.glob(trace.name + "*"))
    where = next(e for e in events if e.kind == "job.stacks_dumped").data["where"]
    assert re.search(r"train_steps\.py:\d+ in main", where["0"]), where
    assert_nothing_left([job])


async def test_a_script_without_an_optimizer_is_not_timed_out(daemon: DaemonProc) -> None:
    """An evaluation steps no optimizer and reports nothing: the progress timeout does not apply to it."""
    spec = daemon.spec(script=[str(SCRIPTS / "evaluate.py"), "--seconds", "3"], nproc=2,
                       timeouts={"progress": 1.0})
    job = await daemon.run(spec)
    assert job.state == JobState.SUCCEEDED, job.root_cause
    assert [r.step for r in job.ranks] == [0, 0]
    events = await _events(daemon, job.id)
    assert not [e for e in events if e.kind == "rank.state_changed" and e.data["to"] == "TRAINING"]
    started = next(e.ts for e in events if e.kind == "rank.joined")
    assert job.finished_at is not None and job.finished_at - started > 3.0
    assert_nothing_left([job])
