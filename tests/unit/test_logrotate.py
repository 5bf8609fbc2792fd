"""Rank log rotation: the policy as pure logic, `rotate` on real files, a real writer appending
during the rotation, and the tricks a job can play with its log path."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from ddpd.daemon.ranklogs.logrotate import (
    LINE_SEARCH,
    Plan,
    RotationError,
    line_start,
    open_live_log,
    plan,
    rotate,
)

from ..conftest import assert_gone

# appends numbered lines with O_APPEND until stdin closes; one byte on stdout per 500 lines
WRITER = r"""
import os, select, sys
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
n = 0
while True:
    os.write(fd, b"line %08d %s\n" % (n, b"x" * 40))
    n += 1
    if n % 500 == 0:
        os.write(1, b".")
        if select.select([0], [], [], 0)[0] and not os.read(0, 1):
            break
"""
LINE = len(b"line %08d %s\n" % (0, b"x" * 40))


def test_plan_keeps_the_newest_half_of_the_limit() -> None:
    assert plan(0, 100) is None
    assert plan(100, 100) is None
    assert plan(101, 100) == Plan(start=51, end=101)
    assert plan(10_000, 100) == Plan(start=9_950, end=10_000)
    assert plan(2, 1) == Plan(start=1, end=2)
    with pytest.raises(ValueError, match="max_bytes"):
        plan(10, 0)


def test_line_start_skips_a_partial_first_line() -> None:
    """`head` starts one byte before the cut."""
    assert line_start(b"xtail of a line\nwhole\n") == len(b"tail of a line\n")
    assert line_start(b"\nwhole\n") == 0  # the cut is at a line start already
    assert line_start(b"no newline at all") == 0
    assert line_start(b"only the end\n") == 0  # nothing would be left after the cut
    assert line_start(b"") == 0
    assert line_start(b"x" * LINE_SEARCH + b"\nmore") == 0  # too far: keep the bytes as they are


def test_a_log_within_the_limit_is_left_alone(tmp_path: Path) -> None:
    log = tmp_path / "rank-0.log"
    log.write_bytes(b"a\n" * 50)
    assert rotate(log, 100) is None
    assert log.read_bytes() == b"a\n" * 50
    assert not (tmp_path / "rank-0.log.1").exists()


def test_rotation_moves_the_newest_part_to_dot_1_and_truncates_in_place(tmp_path: Path) -> None:
    log = tmp_path / "rank-0.log"
    lines = [b"%04d\n" % i for i in range(100)]  # 500 bytes
    log.write_bytes(b"".join(lines))
    inode = log.stat().st_ino
    (tmp_path / "rank-0.log.1").write_bytes(b"older rotation\n")
    done = rotate(log, 200)
    assert done is not None and done.backup == str(tmp_path / "rank-0.log.1")
    kept = (tmp_path / "rank-0.log.1").read_bytes()
    assert kept == b"".join(lines[-20:])  # the last 100 bytes, cut at a line boundary
    assert (done.kept, done.dropped) == (100, 400)
    assert log.read_bytes() == b"" and log.stat().st_ino == inode  # the same file, now empty


def test_the_backup_takes_the_live_logs_mode(tmp_path: Path) -> None:
    log = tmp_path / "rank-1.log"
    log.write_bytes(b"m\n" * 100)
    log.chmod(0o600)
    assert rotate(log, 100) is not None
    backup = (tmp_path / "rank-1.log.1").stat()
    assert stat.S_IMODE(backup.st_mode) == 0o600 and backup.st_uid == log.stat().st_uid


def test_a_writer_appending_during_rotation_keeps_writing_to_the_live_file(tmp_path: Path) -> None:
    log = tmp_path / "rank-0.log"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(log)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE)
    assert writer.stdin is not None and writer.stdout is not None
    try:
        while True:  # each byte read is 500 more lines written
            assert writer.stdout.read(1) == b"."
            if log.stat().st_size > 64 * 1024:
                break
        fd = open_live_log(log)
        try:
            done = rotate(fd, 64 * 1024, tmp_path / "rank-0.log.1")
        finally:
            os.close(fd)
        assert done is not None
        while log.stat().st_size < 1500 * LINE:  # it goes on writing: 1,500 lines in the live file
            assert writer.stdout.read(1) == b"."
    finally:
        writer.stdin.close()
        writer.wait(timeout=30)
    assert_gone(writer.pid)
    live, kept = log.read_bytes(), (tmp_path / "rank-0.log.1").read_bytes()
    assert b"\0" not in live  # O_APPEND: the writer went on at the new end, no hole before it
    numbers = [int(line.split()[1]) for line in live.splitlines()]
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers))) and len(numbers) >= 1500
    backed = [int(line.split()[1]) for line in kept.splitlines()]
    assert backed == list(range(backed[0], backed[0] + len(backed)))  # whole lines, in order
    assert backed[-1] < numbers[0]  # the backup holds what came before the live file
    assert len(kept) <= 64 * 1024  # half the limit, plus at most what was written during the copy


def test_a_symlink_in_place_of_the_log_is_not_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"v" * 1000)
    (tmp_path / "rank-0.log").symlink_to(victim)
    with pytest.raises(RotationError, match="symlink"):
        rotate(tmp_path / "rank-0.log", 100)
    assert victim.read_bytes() == b"v" * 1000
    assert not (tmp_path / "rank-0.log.1").exists()


def test_a_fifo_in_place_of_the_log_is_refused_without_blocking(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "rank-0.log")  # nobody writes it: an open without O_NONBLOCK would hang
    with pytest.raises(RotationError, match="not a regular file"):
        rotate(tmp_path / "rank-0.log", 100)


def test_a_symlink_planted_as_dot_1_is_replaced_not_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious\n")
    (tmp_path / "rank-0.log.1").symlink_to(victim)
    log = tmp_path / "rank-0.log"
    log.write_bytes(b"y\n" * 200)
    assert rotate(log, 100) is not None
    assert victim.read_bytes() == b"precious\n"
    backup = tmp_path / "rank-0.log.1"
    assert not backup.is_symlink() and backup.read_bytes() == b"y\n" * 25


def test_the_held_fd_rotates_the_file_the_rank_writes_whatever_the_path_became(tmp_path: Path) -> None:
    """A job that replaces its log path by a FIFO cannot redirect the daemon: the fd it holds is the
    file the rank's stdout still writes."""
    log = tmp_path / "rank-0.log"
    log.write_bytes(b"z\n" * 200)
    fd = open_live_log(log)
    try:
        log.unlink()
        os.mkfifo(log)
        done = rotate(fd, 100, tmp_path / "rank-0.log.1")
        assert done is not None and os.fstat(fd).st_size == 0
    finally:
        os.close(fd)
    assert (tmp_path / "rank-0.log.1").read_bytes() == b"z\n" * 25


def test_rotating_an_fd_needs_the_backup_path(tmp_path: Path) -> None:
    (tmp_path / "rank-0.log").write_bytes(b"q" * 10)
    fd = open_live_log(tmp_path / "rank-0.log")
    try:
        with pytest.raises(ValueError, match="backup"):
            rotate(fd, 5)
    finally:
        os.close(fd)
