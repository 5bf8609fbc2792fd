"""The stamp index of a rank log as pure logic (lookup, `since`, pruning, a spoiled file), the
split of a read into stamped runs and the tail of a byte buffer, and `tick` on real files with the
time passed in."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ddpd.daemon.ranklogs.logindex import (
    MAX_ENTRIES,
    RECORD,
    Index,
    LiveStream,
    RankLogs,
    decode,
    segments,
    tail_start,
    tick,
)
from ddpd.daemon.ranklogs.logseek import line_starts


def index(*entries: tuple[int, float]) -> Index:
    out = Index()
    for offset, when in entries:
        assert out.add(offset, when)
    return out


def test_a_line_takes_the_first_entry_at_or_after_its_end() -> None:
    idx = index((10, 100.0), (25, 101.0), (40, 102.5))
    assert idx.stamp(1) == 100.0 and idx.stamp(10) == 100.0
    assert idx.stamp(11) == 101.0 and idx.stamp(25) == 101.0
    assert idx.stamp(40) == 102.5
    assert idx.stamp(41) is None  # written since the last tick


def test_since_starts_at_the_entry_before_the_first_at_or_after_the_time() -> None:
    idx = index((10, 100.0), (25, 101.0), (40, 102.5))
    assert idx.since_offset(50.0) == 0
    assert idx.since_offset(100.0) == 0
    assert idx.since_offset(100.5) == 10  # lines ending after 10 are stamped 101.0 or later
    assert idx.since_offset(102.5) == 25
    assert idx.since_offset(200.0) == 40  # nothing stamped yet: only what came after the last tick
    assert Index().since_offset(5.0) == 0


def test_entries_only_go_forward() -> None:
    idx = index((10, 100.0))
    assert not idx.add(10, 101.0) and not idx.add(5, 101.0) and not idx.add(20, 99.0)
    assert not idx.add(20, float("nan")) and not idx.add(-1, 101.0)
    assert idx.add(20, 100.0) and len(idx) == 2


def test_a_spoiled_index_keeps_what_goes_forward() -> None:
    good = index((10, 1.0), (20, 2.0), (30, 3.0)).encode()
    spoiled = good[:16] + RECORD.pack(5, 9.0) + good[16:] + b"\xff" * 7  # a step back and a torn record
    idx = decode(spoiled)
    assert list(idx.offsets) == [10, 20, 30] and list(idx.times) == [1.0, 2.0, 3.0]
    assert len(decode(os.urandom(1000))) <= 1000 // RECORD.size
    assert len(decode(b"".join(RECORD.pack(i, float(i)) for i in range(1, 3 * MAX_ENTRIES)))) == 2 * MAX_ENTRIES


def test_a_rotation_keeps_the_entries_of_the_kept_part_relative_to_it() -> None:
    idx = index((10, 1.0), (25, 2.0), (40, 3.0), (60, 4.0))
    kept = idx.shifted(20, 50)  # bytes [20, 50) of the live log became the backup
    assert list(kept.offsets) == [5, 20, 30] and list(kept.times) == [2.0, 3.0, 4.0]
    assert list(idx.shifted(20, 40).offsets) == [5, 20]


def test_thinning_drops_every_other_older_entry_and_keeps_the_newest_half() -> None:
    idx = index(*((i * 10, float(i)) for i in range(1, 9)))
    thin = idx.thinned()
    assert list(thin.offsets) == [10, 30, 50, 60, 70, 80]
    assert thin.stamp(15) == 3.0  # a coarser stamp for old lines, never an earlier one


def test_a_read_splits_into_runs_of_whole_lines_that_share_a_stamp() -> None:
    data = b"a1\na2\nb1\nb2\npart"
    idx = index((100 + 4, 1.0), (100 + 12, 2.0))  # the first tick saw "a1\na" (mid-line), the next b2's end
    runs, used = segments(data, 100, idx, default=9.0, final=False)
    assert runs == [(1.0, b"a1\n"), (2.0, b"a2\nb1\nb2\n")] and used == 12  # "part" waits for its newline
    runs, used = segments(data, 100, idx, default=9.0, final=True)
    assert runs[-1] == (9.0, b"part") and used == len(data)
    # from the middle: entries at or before the start stamp nothing
    assert segments(b"b2\n", 109, idx, default=9.0, final=False) == ([(2.0, b"b2\n")], 3)
    assert segments(b"no newline yet", 0, Index(), default=9.0, final=False) == ([], 0)


def test_the_tail_of_a_buffer() -> None:
    assert tail_start(b"l1\nl2\nl3\n", 2, at_start=True) == 3
    assert tail_start(b"l1\nl2\nl3", 2, at_start=True) == 3  # a last line without its newline counts
    assert tail_start(b"l1\nl2\n", 5, at_start=True) == 0
    assert tail_start(b"1\nl2\n", 5, at_start=False) is None  # read further back
    assert tail_start(b"l1\n", 0, at_start=True) == 3
    assert line_starts(b"a\nbb\nc", 10) == [10, 12, 15]


def _stream(tmp_path: Path, name: str) -> tuple[LiveStream, int]:
    writer = os.open(tmp_path / name, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    rw = os.open(f"/proc/self/fd/{writer}", os.O_RDWR)
    idx = os.open(tmp_path / f"{name}.idx", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    return LiveStream(log=str(tmp_path / name), fd=rw, index_fd=idx), writer


def test_tick_notes_growth_once_and_rotation_keeps_the_newest_with_their_stamps(tmp_path: Path) -> None:
    stream, writer = _stream(tmp_path, "rank-0.log")
    try:
        assert tick(stream, 10.0, 64 * 1024) is None
        assert (tmp_path / "rank-0.log.idx").read_bytes() == b""  # nothing written: no entry
        os.write(writer, b"".join(b"old %05d\n" % i for i in range(5000)))  # 50 000 bytes
        tick(stream, 11.0, 64 * 1024)
        tick(stream, 11.25, 64 * 1024)  # no growth: no entry
        assert list(decode((tmp_path / "rank-0.log.idx").read_bytes()).times) == [11.0]
        os.write(writer, b"".join(b"new %05d\n" % i for i in range(5000)))
        done = tick(stream, 12.0, 64 * 1024)
        assert done is not None and done.kept <= 32 * 1024
        backup = (tmp_path / "rank-0.log.1").read_bytes()
        assert backup.endswith(b"new 04999\n") and backup.startswith(b"new ")  # the newest, whole lines
        kept = decode((tmp_path / "rank-0.log.1.idx").read_bytes())
        assert kept.offsets[-1] == len(backup) and kept.stamp(len(backup)) == 12.0
        assert (tmp_path / "rank-0.log").read_bytes() == b"" and (tmp_path / "rank-0.log.idx").read_bytes() == b""
        os.write(writer, b"after\n")
        tick(stream, 13.0, 64 * 1024)
        assert list(decode((tmp_path / "rank-0.log.idx").read_bytes()).offsets) == [6]
    finally:
        stream.close()
        os.close(writer)


def test_tick_thins_a_long_index_and_starts_over_when_the_job_truncates_its_log(tmp_path: Path) -> None:
    stream, writer = _stream(tmp_path, "rank-0.err")
    try:
        for i in range(MAX_ENTRIES + 1):
            os.write(writer, b"x")
            tick(stream, float(i), 1 << 30)
        on_disk = decode((tmp_path / "rank-0.err.idx").read_bytes())
        assert len(on_disk) == len(stream.index) < MAX_ENTRIES
        assert on_disk.offsets[-1] == MAX_ENTRIES + 1
        os.ftruncate(writer, 0)
        os.write(writer, b"again\n")
        tick(stream, 1e6, 1 << 30)
        assert list(decode((tmp_path / "rank-0.err.idx").read_bytes()).offsets) == [6]
    finally:
        stream.close()
        os.close(writer)


def test_rank_logs_close_their_fds_once_and_tick_no_more(tmp_path: Path) -> None:
    stream, writer = _stream(tmp_path, "rank-1.log")
    try:
        logs = RankLogs([stream])
        os.write(writer, b"x\n")
        assert logs.tick_all(1.0, 1 << 30) == [] and len(stream.index) == 1
        logs.close()
        logs.close()
        assert logs.tick_all(2.0, 1 << 30) == [] and logs.streams == []
        for fd in (stream.fd, stream.index_fd):
            with pytest.raises(OSError, match="Bad file descriptor"):
                os.fstat(fd)
    finally:
        os.close(writer)
