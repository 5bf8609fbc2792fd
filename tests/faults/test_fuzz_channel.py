"""The daemon's end of a worker channel: any byte stream becomes frames or a FrameError (a property),
and a rank that floods it is failed while the daemon keeps serving (a real daemon and worker)."""

from __future__ import annotations

import socket

import anyio
import msgspec
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ddpd.daemon.pool.channel import WorkerChannel
from ddpd.protocol import MAX_FRAME, FrameError, JobState, encode
from ddpd.protocol.channel import Heartbeat, Hello, PhaseChanged, Progress, WorkerMessage

from ..conftest import DaemonProc, assert_nothing_left
from .helpers import report_line, wait_while_pinging

VALID: list[WorkerMessage] = [
    Hello(version=1, pid=1, python="3.11", torch=None),
    PhaseChanged(phase="joined"),
    Heartbeat(step=3),
    Progress(step=4, loss=0.5),
]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
frames = st.one_of(
    st.binary(max_size=512),
    st.sampled_from(VALID).map(encode).flatmap(lambda b: st.integers(0, len(b)).map(lambda n: b[:n])),
    st.integers(1, 100_000).map(lambda depth: b"[" * depth + b"]" * depth + b"\n"),
    st.fixed_dictionaries({"type": st.sampled_from(["hello", "phase", "hb", "progress", "result", "failure",
                                                    "checkpointed", "nope"])},
                          optional={"step": json_values, "phase": json_values, "pid": json_values,
                                    "version": json_values, "extra": json_values})
    .map(lambda d: msgspec.json.encode(d) + b"\n"),
)
streams = st.tuples(st.lists(frames, max_size=6), st.lists(st.integers(1, 64), min_size=1, max_size=8))


async def _decode(payload: bytes, cuts: list[int]) -> tuple[list[WorkerMessage], FrameError | None]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    channel = WorkerChannel(ours)
    got: list[WorkerMessage] = []
    error: FrameError | None = None

    async def write() -> None:
        view, i = memoryview(payload), 0
        with theirs:
            while view:  # in uneven pieces: frames split anywhere
                n = cuts[i % len(cuts)] * 97
                await anyio.to_thread.run_sync(theirs.sendall, view[:n])
                view, i = view[n:], i + 1

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(write)
            try:
                async for message in channel.frames():
                    got.append(message)
            except FrameError as exc:
                error = exc
                tg.cancel_scope.cancel()
    channel.close()
    return got, error


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams)
@example(([b"x" * (MAX_FRAME + 1)], [64]))
@example(([b"[" * 50_000], [64]))
def test_worker_channel_decoder_never_breaks(stream: tuple[list[bytes], list[int]]) -> None:
    parts, cuts = stream
    payload = b"".join(parts)
    got, error = anyio.run(_decode, payload, cuts)
    if error is not None:
        assert error.code in ("malformed_frame", "bad_message", "frame_too_large"), error.code
    # every whole, valid frame before the first bad one came through unchanged
    expected: list[WorkerMessage] = []
    for line in payload.split(b"\n")[:-1]:
        try:
            expected.append(msgspec.json.decode(line, type=WorkerMessage))
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):  # deep nesting: a bad frame
            break
    assert got[: len(expected)] == expected if error is not None else got == expected


@pytest.mark.anyio
async def test_a_rank_flooding_its_channel_is_failed_and_the_daemon_keeps_answering(daemon: DaemonProc) -> None:
    """Bug: two ranks flooding Heartbeat frames starved the loop (one ping took 14.9 s). Each rank has a
    frame budget and the reader yields between batches: the flooding rank is named, ping stays answered."""
    spec = daemon.spec(task="tests.tasks:flood_heartbeats", nproc=2, steps=100_000,
                       options={"rank": 1, "at_step": 3, "step_sleep": 0.02}, timeouts={"kill_grace": 2.0})
    job_id = await daemon.client.submit(spec)
    await daemon.wait_event(job_id, lambda e: e.kind == "rank.progress")
    job, pinger = await wait_while_pinging(daemon, job_id)
    report_line(f"Heartbeat flood: worst ping {pinger.worst * 1000:.1f} ms over {pinger.count} pings")
    assert job.state == JobState.FAILED, job.root_cause
    rc = job.root_cause
    assert rc is not None and rc.reason == "protocol_error" and rc.rank == 1, rc
    assert "rank 1 flooded its channel" in (rc.detail or ""), rc
    await daemon.client.ping()
    assert_nothing_left([job])
