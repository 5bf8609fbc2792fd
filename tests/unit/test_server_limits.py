"""Bounds of the control server as pure logic: the request reader's size and time limits, and
replies that stay one frame (clipped views, pages of `list`)."""

from __future__ import annotations

import time

import anyio
import msgspec
import pytest

from ddpd.daemon.control.replies import PAGE_BUDGET, clip_event, fit_view, job_page
from ddpd.daemon.control.requests import FrameReader, ReadTimeout
from ddpd.daemon.store import errors
from ddpd.daemon.store.errors import DaemonError
from ddpd.daemon.store.records import Job
from ddpd.protocol import MAX_FRAME, FrameError, JobSpec, JobState
from ddpd.protocol.control import EventView, RootCause
from ddpd.protocol.errors import ErrorCode

pytestmark = pytest.mark.anyio


async def _reader(chunks: list[bytes], limit: int = 64) -> tuple[FrameReader, anyio.abc.ObjectSendStream[bytes]]:

    send, recv = anyio.create_memory_object_stream[bytes](100)
    for chunk in chunks:
        send.send_nowait(chunk)
    return FrameReader(_Bytes(recv), limit), send


class _Bytes:
    """A byte receive stream over a memory object stream (what a socket gives, chunk by chunk)."""

    def __init__(self, recv: anyio.abc.ObjectReceiveStream[bytes]) -> None:
        self._recv = recv

    async def receive(self, max_bytes: int = 65536) -> bytes:
        return await self._recv.receive()  # EndOfStream once the sender is closed

    async def aclose(self) -> None:
        await self._recv.aclose()


async def test_frames_split_across_reads_and_pipelined() -> None:
    reader, send = await _reader([b'{"a":', b"1}\n{", b'"b":2}\n\n'])
    send.close()
    assert await reader.next_frame(1, 1) == b'{"a":1}'
    assert await reader.next_frame(1, 1) == b'{"b":2}'
    assert await reader.next_frame(1, 1) == b""
    assert await reader.next_frame(1, 1) is None  # the client closed


async def test_a_frame_over_the_limit_is_refused() -> None:
    reader, _send = await _reader([b"x" * 100])
    with pytest.raises(FrameError) as err:
        await reader.next_frame(1, 1)
    assert err.value.code == "frame_too_large"
    reader, _send = await _reader([b"y" * 70 + b"\n"])
    with pytest.raises(FrameError):
        await reader.next_frame(1, 1)


async def test_idle_and_partial_deadlines() -> None:
    reader, _send = await _reader([])
    start = time.monotonic()
    with pytest.raises(ReadTimeout) as err:
        await reader.next_frame(idle=0.05, frame=10)
    assert not err.value.partial and time.monotonic() - start < 5
    reader, _send = await _reader([b'{"op"'])
    with pytest.raises(ReadTimeout) as err:
        await reader.next_frame(idle=10, frame=0.05)
    assert err.value.partial


def _job(seq: int, state: JobState = JobState.SUCCEEDED, **spec: object) -> Job:
    return Job(id=f"j{seq}", seq=seq, name="n", owner_uid=0, spec=JobSpec(**spec),  # type: ignore[arg-type]
               state=state, submitted_at=0.0)


def test_views_clip_root_cause_texts() -> None:
    """The bug: a 400 KB exception message made every status, wait and ls fail for good."""
    job = _job(1, JobState.FAILED)
    job.root_cause = RootCause(reason="exception", message="m" * 400_000, traceback="t" * 900_000, detail="d" * 10)
    view = fit_view(job.view())
    assert view.root_cause is not None
    assert len(view.root_cause.message or "") <= 8192 and len(view.root_cause.traceback or "") <= 8192
    assert view.root_cause.detail == "d" * 10
    assert len(msgspec.json.encode(view)) < 64 * 1024


def test_a_view_too_large_even_clipped_loses_its_free_text() -> None:
    job = _job(1, env={f"K{i}": "v" * 16_000 for i in range(100)})  # stored before the request limit
    view = fit_view(job.view())
    assert len(msgspec.json.encode(view)) <= PAGE_BUDGET and view.spec.env == {}


def test_pages_newest_first_bounded_by_count_and_size() -> None:
    jobs = [_job(i, JobState.QUEUED if i % 2 else JobState.SUCCEEDED) for i in range(1, 11)]
    first = job_page(jobs, active_only=False, limit=4, before=None)
    assert [j.id for j in first.jobs] == ["j10", "j9", "j8", "j7"] and first.next == 7
    rest = job_page(jobs, active_only=False, limit=100, before=first.next)
    assert [j.id for j in rest.jobs] == [f"j{i}" for i in range(6, 0, -1)] and rest.next is None
    active = job_page(jobs, active_only=True, limit=100, before=None)
    assert [j.id for j in active.jobs] == ["j9", "j7", "j5", "j3", "j1"]
    big = [_job(i, env={f"K{k}": "v" * 200 for k in range(250)}) for i in range(1, 41)]
    page = job_page(big, active_only=False, limit=500, before=None)
    assert 0 < len(page.jobs) < 40 and page.next == int(page.jobs[-1].id[1:])
    assert len(msgspec.json.encode(page)) < MAX_FRAME


def test_events_are_clipped() -> None:
    event = EventView(seq=1, ts=0.0, kind="rank.failed", data={"traceback": "x" * 500_000, "n": [1, "y" * 9000]})
    clipped = clip_event(event)
    assert len(msgspec.json.encode(clipped)) < 20_000 and clipped.data["n"][0] == 1


def test_every_expected_failure_is_a_daemon_error_with_its_own_code() -> None:
    kinds = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, DaemonError)]
    codes = [kind.code for kind in kinds if kind is not DaemonError]
    assert len(codes) >= 9 and len(set(codes)) == len(codes) and ErrorCode.INTERNAL not in codes
    assert all(kind("x").message == "x" and str(kind("x")) == "x" for kind in kinds)
