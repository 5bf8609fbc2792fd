"""Storage trouble against a real daemon: a locked database refuses new work without making a ghost,
running jobs survive it, a retried submit never runs twice, and an unusable state directory stops the
start with one line and exit status 78 (systemd does not restart on it)."""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio
import pytest

from ddpd.protocol import JobState, RemoteError

from ..conftest import REPO, DaemonProc, daemon_argv, running_daemon

pytestmark = pytest.mark.anyio

EX_CONFIG = 78


@contextmanager
def locked(path: Path) -> Iterator[sqlite3.Connection]:
    """Another process holding the state database with BEGIN EXCLUSIVE."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("BEGIN EXCLUSIVE")
    try:
        yield conn
    finally:
        conn.rollback()
        conn.close()


def db_state(d: DaemonProc, job_id: str) -> str:
    with sqlite3.connect(d.state_dir / "ddpd.db") as conn:
        return str(conn.execute("SELECT state FROM jobs WHERE id = ?", (job_id,)).fetchone()[0])


async def test_locked_database_refuses_new_work_and_makes_no_ghost(short_tmp: Path) -> None:
    """Bug: a submit that failed with `database is locked` still ran its job, and a retry ran it twice."""
    async with running_daemon(short_tmp, "--cpu-slots", "2") as d:
        with locked(d.state_dir / "ddpd.db"), anyio.fail_after(30), pytest.raises(RemoteError) as info:
            await d.client.submit(d.spec(task="two-layer", nproc=1, steps=1))
        assert info.value.code == "storage_unavailable"
        assert "could not be saved" in info.value.message
        assert await d.client.ping() is not None
        assert await d.client.list_jobs() == []  # no ghost, in memory or on disk
        job = await d.run(d.spec(task="two-layer", nproc=1, steps=1))
        assert job.state == JobState.SUCCEEDED.value
        assert [j.id for j in await d.client.list_jobs()] == [job.id]


async def test_running_job_survives_a_locked_database(short_tmp: Path) -> None:
    async with running_daemon(short_tmp, "--cpu-slots", "2") as d:
        gate = short_tmp / "gate"
        job_id = await d.client.submit(d.spec(task="tests.scripts.gated:make_task", nproc=2, steps=2,
                                              options={"gate": str(gate)}))
        await d.wait_event(job_id, lambda e: e.kind == "job.state_changed" and e.data.get("to") == "RUNNING")
        with locked(d.state_dir / "ddpd.db"):
            gate.touch()  # the job finishes while its writes find the database locked
            await d.wait_log(lambda e: e.get("event") == "journal.write_retry" and e.get("job_id") == job_id)
            assert await d.client.ping() is not None  # the loop keeps answering
        with anyio.fail_after(120):
            job = await d.client.wait(job_id)
        assert job.state == JobState.SUCCEEDED.value, job.root_cause
        assert db_state(d, job_id) == JobState.SUCCEEDED.value  # the retried writes landed


async def test_retried_submit_with_a_key_runs_once(short_tmp: Path) -> None:
    async with running_daemon(short_tmp, "--cpu-slots", "2") as d:
        spec = d.spec(task="two-layer", nproc=1, steps=1)
        first = await d.client.submit_result(spec, idempotency_key="nightly-7")
        second = await d.client.submit_result(spec, idempotency_key="nightly-7")
        assert first.job_id == second.job_id
        assert (first.existing, second.existing) == (False, True)
        with anyio.fail_after(120):
            job = await d.client.wait(first.job_id)
        assert job.state == JobState.SUCCEEDED.value and job.attempt == 1
        assert len(await d.client.list_jobs()) == 1
        with pytest.raises(RemoteError, match="idempotency_key"):
            await d.client.submit_result(spec, idempotency_key="x" * 1000)


def serve_unusable(base: Path, state_dir: Path) -> subprocess.CompletedProcess[str]:
    argv = daemon_argv(base / "ddpd.sock", state_dir, "--gpus", "0")
    return subprocess.run(argv, cwd=str(REPO), capture_output=True, text=True, timeout=60, check=False)


def assert_one_line(result: subprocess.CompletedProcess[str], *words: str) -> None:
    assert result.returncode == EX_CONFIG, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for word in words:
        assert word in lines[0]


def test_state_dir_that_is_a_file_exits_78(short_tmp: Path) -> None:
    where = short_tmp / "state"
    where.write_text("")
    assert_one_line(serve_unusable(short_tmp, where), str(where), "not a directory")


def test_corrupt_database_exits_78(short_tmp: Path) -> None:
    where = short_tmp / "state"
    where.mkdir()
    (where / "ddpd.db").write_bytes(b"not sqlite " * 500)
    assert_one_line(serve_unusable(short_tmp, where), str(where / "ddpd.db"), "not a database")


def test_read_only_state_dir_exits_78(short_tmp: Path) -> None:
    where = short_tmp / "state"
    where.mkdir()
    chattr = shutil.which("chattr")
    immutable = False
    if os.geteuid() == 0:  # root writes through permission bits: make the directory immutable
        immutable = chattr is not None and subprocess.run([chattr, "+i", str(where)], capture_output=True,
                                                          check=False).returncode == 0
        if not immutable:
            pytest.skip("root needs chattr +i (and a filesystem that supports it) to make a directory unwritable")
    else:
        where.chmod(0o500)
    try:
        assert_one_line(serve_unusable(short_tmp, where), str(where))
    finally:
        if immutable and chattr is not None:
            subprocess.run([chattr, "-i", str(where)], capture_output=True, check=False)
        where.chmod(0o700)


@contextmanager
def small_filesystem(where: Path, size: str = "4m") -> Iterator[Path]:
    """A tmpfs of `size` mounted at `where` (root only), unmounted afterwards."""
    where.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                                           capture_output=True, check=False).returncode != 0:
        pytest.skip("needs root and tmpfs mounts to fill a filesystem")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, check=False)


def fill(path: Path) -> None:
    """Write zeros into `path` until the filesystem is full."""
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass


async def test_full_disk_refuses_new_work_then_recovers(short_tmp: Path) -> None:
    with small_filesystem(short_tmp / "fs") as fs:
        async with running_daemon(short_tmp, "--cpu-slots", "2", state_dir=fs / "state") as d:
            filler = fs / "filler"
            fill(filler)
            with anyio.fail_after(60), pytest.raises(RemoteError) as info:
                await d.client.submit(d.spec(task="two-layer", nproc=1, steps=1))
            assert info.value.code == "storage_unavailable"
            assert await d.client.list_jobs() == []  # no ghost
            filler.unlink()
            job = await d.run(d.spec(task="two-layer", nproc=1, steps=1))
            assert job.state == JobState.SUCCEEDED.value
