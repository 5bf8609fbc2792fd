"""What a `logs` request may ask, parsed as pure logic: rank sets, start times, stamps."""

from __future__ import annotations

from datetime import UTC, datetime

import msgspec
import pytest

from ddpd.protocol.control import Logs
from ddpd.protocol.logquery import MAX_TAIL, QueryError, format_stamp, parse_rank_set, parse_since
from ddpd.protocol.spec import MAX_NPROC, MAX_WORLD


def test_rank_sets_take_ranks_and_ranges() -> None:
    assert parse_rank_set("0") == [0]
    assert parse_rank_set("0,2-3") == [0, 2, 3]
    assert parse_rank_set(" 3 , 1-2,2 ") == [1, 2, 3]
    assert parse_rank_set(f"0-{MAX_NPROC - 1}") == list(range(MAX_NPROC))
    assert parse_rank_set(f"{MAX_WORLD - 2}-{MAX_WORLD - 1}") == [MAX_WORLD - 2, MAX_WORLD - 1]  # global ranks


@pytest.mark.parametrize(("text", "problem"), [
    ("", "an empty item"),
    ("0,,1", "an empty item"),
    ("a", "is not a rank or a range"),
    ("1-x", "is not a rank or a range"),
    ("-1", "is not a rank or a range"),  # "-1" reads as an empty start of a range
    ("3-1", "runs backwards"),
    (f"0-{10**12}", "out of range"),  # refused, never expanded
    (str(MAX_WORLD), "out of range"),
    (f"0-{MAX_NPROC}", f"more than {MAX_NPROC} ranks"),
    (f"0-{MAX_NPROC // 2},{MAX_NPROC}-{MAX_NPROC * 3 // 2}", f"more than {MAX_NPROC} ranks"),
    ("1," * 5000, "longer than"),
])
def test_bad_rank_sets_name_their_problem(text: str, problem: str) -> None:
    with pytest.raises(QueryError, match=problem):
        parse_rank_set(text)


def test_since_takes_durations_and_iso_times() -> None:
    now = 1_000_000.0
    assert parse_since("30s", now) == now - 30
    assert parse_since("10m", now) == now - 600
    assert parse_since("2h", now) == now - 7200
    assert parse_since("1d", now) == now - 86400
    assert parse_since("1.5m", now) == now - 90
    assert parse_since("2026-12-03T17:35:44+00:00", now) == datetime(2026, 12, 3, 17, 35, 44, tzinfo=UTC).timestamp()
    assert parse_since("2026-12-03T17:35:44Z", now) == datetime(2026, 12, 3, 17, 35, 44, tzinfo=UTC).timestamp()
    local = datetime(2026, 12, 3, 17, 35, 44).astimezone().timestamp()  # no zone: local time
    assert parse_since("2026-12-03 17:35:44", now) == local


@pytest.mark.parametrize("text", ["", "10", "10x", "ten minutes", "-5m", "2026-13-45"])
def test_bad_since_names_what_it_takes(text: str) -> None:
    with pytest.raises(QueryError, match="not a duration"):
        parse_since(text, 0.0)


def test_a_stamp_is_iso_8601_utc_with_milliseconds() -> None:
    when = datetime(2026, 12, 3, 17, 35, 44, 250_000, tzinfo=UTC).timestamp()
    assert format_stamp(when) == "2026-12-03T17:35:44.250Z"


def test_a_logs_request_is_bounded_at_the_door() -> None:
    decode = msgspec.json.Decoder(Logs)
    ok = decode.decode(b'{"op":"logs","id":1,"job_id":"j","ranks":[0,2,3],"stream":"stderr","tail":5,"since":1.5}')
    assert ok.ranks == [0, 2, 3] and ok.stream == "stderr" and ok.tail == 5 and ok.since == 1.5
    for bad, field in [(b'"ranks":[]', "ranks"), (b'"ranks":[-1]', "ranks"), (b'"stream":"stdin"', "stream"),
                       (b'"tail":%d' % (MAX_TAIL + 1), "tail"), (b'"since":-1', "since"),
                       (b'"ranks":[%s]' % b",".join(b"0" for _ in range(MAX_NPROC + 1)), "ranks")]:
        with pytest.raises(msgspec.ValidationError, match=field):
            decode.decode(b'{"op":"logs","id":1,"job_id":"j",' + bad + b"}")
