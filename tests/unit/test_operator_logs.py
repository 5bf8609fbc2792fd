"""The daemon's log for operators: one line per job state change on a terminal, and native journald
records (PRIORITY, JOB_ID, MESSAGE) received by a real datagram socket."""

from __future__ import annotations

import io
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from ddpd.daemon.journald import RECORD_LIMIT, decode_record, encode_record
from ddpd.daemon.logs import configure_logging, resolve_format
from ddpd.daemon.store.bus import EventBus
from ddpd.daemon.store.journal import Journal
from ddpd.daemon.store.records import Job, Rank
from ddpd.daemon.store.state import StateDB
from ddpd.protocol import JobSpec, JobState, RankState

pytestmark = pytest.mark.anyio


@pytest.fixture(autouse=True)
def reset_structlog() -> Iterator[None]:
    yield
    structlog.reset_defaults()


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[Journal]:
    db = StateDB(tmp_path / "ddpd.db")
    yield Journal(db, EventBus())
    db.close()


async def a_job_runs(journal: Journal) -> Job:
    """A job's life as the scheduler and the supervisor record it: its states, its rank's phases."""
    job = Job(id="j12-ab3c", seq=12, name="t", owner_uid=1000, spec=JobSpec(task="two-layer"),
              state=JobState.QUEUED, submitted_at=time.time())
    await journal.create_job(job)
    await journal.event(job, "job.submitted", owner_uid=1000, nproc=1, task="two-layer", script=None)
    job.attempt = 1
    with structlog.contextvars.bound_contextvars(job_id=job.id):
        await journal.job_state(job, JobState.STARTING, "attempt 1")
        rank = Rank(rank=0, attempt=1)
        for state in (RankState.CONNECTED, RankState.STORE_CONNECTED, RankState.JOINED, RankState.TRAINING):
            await journal.rank_state(job, rank, state)
        await journal.job_state(job, JobState.RUNNING, "all ranks joined")
        structlog.get_logger("ddpd").warning("rank.slow", attempt=1, rank=0, detail="line one\nline two")
        await journal.rank_state(job, rank, RankState.EXITED, exit_code=0)
        await journal.job_state(job, JobState.SUCCEEDED, "all ranks succeeded")
        await journal.event(job, "job.finished", state="SUCCEEDED", attempts=1)
    return job


async def test_a_terminal_gets_one_line_per_state_change(journal: Journal) -> None:
    out = io.StringIO()
    configure_logging("info", "human", stream=io.StringIO())  # warnings held from before (another test's config)
    configure_logging("info", "human", stream=out)
    await a_job_runs(journal)
    lines = out.getvalue().splitlines()
    assert [line.split(" ", 1)[1] for line in lines] == [
        "j12-ab3c QUEUED (two-layer, 1 rank, uid 1000)",
        "j12-ab3c QUEUED -> STARTING (attempt 1)",
        "j12-ab3c STARTING -> RUNNING (all ranks joined)",
        "WARNING rank.slow j12-ab3c rank 0 detail=line one\\nline two",
        "j12-ab3c RUNNING -> SUCCEEDED (all ranks succeeded)",
    ]
    assert all(len(line.split(" ", 1)[0]) == len("17:40:29") for line in lines)


async def test_journald_records_carry_priority_and_the_job(journal: Journal, tmp_path: Path) -> None:
    path = tmp_path / "journal.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as receiver:
        receiver.bind(str(path))
        receiver.setblocking(False)
        configure_logging("info", "journald", stream=io.StringIO(), journal=path)
        await a_job_runs(journal)
        records = []
        while True:  # each record was sent before its event returned: all are queued here now
            try:
                records.append(dict(decode_record(receiver.recv(RECORD_LIMIT + 1024))))
            except BlockingIOError:
                break
    changes = [r for r in records if r["DDPD_EVENT"] == "job.state_changed"]
    assert [(r["PRIORITY"], r["JOB_ID"], r["ATTEMPT"], r["MESSAGE"]) for r in changes] == [
        ("6", "j12-ab3c", "1", "j12-ab3c QUEUED -> STARTING (attempt 1)"),
        ("6", "j12-ab3c", "1", "j12-ab3c STARTING -> RUNNING (all ranks joined)"),
        ("6", "j12-ab3c", "1", "j12-ab3c RUNNING -> SUCCEEDED (all ranks succeeded)"),
    ]
    assert all(r["SYSLOG_IDENTIFIER"] == "ddpd" and r["DDPD_FROM"] for r in changes)
    warning = next(r for r in records if r["DDPD_EVENT"] == "rank.slow")
    assert (warning["PRIORITY"], warning["JOB_ID"], warning["RANK"]) == ("4", "j12-ab3c", "0")
    assert warning["DDPD_DETAIL"] == "line one\nline two"  # a newline travels binary-safe
    assert len([r for r in records if r["DDPD_EVENT"] == "rank.state_changed"]) == 5  # every event goes there


def test_a_record_stays_bounded() -> None:
    record = encode_record({"MESSAGE": "m", "PRIORITY": "3", "JOB_ID": "j1-a",
                            **{f"DDPD_F{i}": "x" * 10_000 for i in range(20)}})
    assert len(record) <= RECORD_LIMIT and dict(decode_record(record)) == {"MESSAGE": "m", "PRIORITY": "3",
                                                                          "JOB_ID": "j1-a"}


def test_without_journald_the_records_stay_on_the_stream(tmp_path: Path) -> None:
    out = io.StringIO()
    configure_logging("info", "journald", stream=out, journal=tmp_path / "absent.sock")
    structlog.get_logger("ddpd").error("daemon.trouble", job_id="j1-a")
    assert '"PRIORITY": "3"' in out.getvalue() and '"JOB_ID": "j1-a"' in out.getvalue()


def test_auto_picks_journald_for_the_journal_stream_and_human_for_a_terminal(
        monkeypatch: pytest.MonkeyPatch) -> None:
    left, right = socket.socketpair()
    with left, right, os.fdopen(os.dup(left.fileno()), "w") as stream:
        st = os.fstat(stream.fileno())
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
        assert resolve_format("auto", stream) == "journald"
        assert resolve_format("json", stream) == "json"
        monkeypatch.setenv("JOURNAL_STREAM", "1:2")
        assert resolve_format("auto", stream) == "json"
    leader, follower = os.openpty()
    with os.fdopen(leader, "w") as tty, os.fdopen(follower, "w") as _:
        assert resolve_format("auto", tty) == "human"
