"""The daemon's end of a worker channel over a real socket pair: frames in order, heartbeats applied
in the event loop's callback without waking the reader, a bounded queue, the end and bad frames."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import anyio
import anyio.lowlevel
import anyio.to_thread
import pytest

from ddpd.daemon.attempt.ranks import FrameBudget, heartbeat_applier
from ddpd.daemon.pool.channel import QUEUE_LIMIT, READ_SIZE, WorkerChannel
from ddpd.daemon.run.clock import RealClock
from ddpd.daemon.store.records import Rank
from ddpd.protocol import FrameError, RankState
from ddpd.protocol.channel import Heartbeat, PhaseChanged, Progress, WorkerMessage

pytestmark = pytest.mark.anyio
WAIT = 10


@pytest.fixture
def pair() -> Iterator[tuple[WorkerChannel, socket.socket]]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    channel = WorkerChannel(ours)
    yield channel, theirs
    channel.close()
    theirs.close()


def hb(step: int) -> bytes:
    return b'{"type":"hb","step":%d}\n' % step


async def test_frames_come_in_order_and_end_when_the_worker_closes(
        pair: tuple[WorkerChannel, socket.socket]) -> None:
    channel, theirs = pair
    theirs.sendall(b'{"type":"phase","phase":"joined"}\n' + hb(1) + b'{"type":"progress","step":2,"loss":0.5}\n')
    theirs.close()
    with anyio.fail_after(WAIT):
        got = [m async for m in channel.frames()]
    assert [type(m) for m in got] == [PhaseChanged, Heartbeat, Progress]
    with anyio.fail_after(WAIT):  # a later reader ends at once too
        assert [m async for m in channel.frames()] == []


async def test_a_heartbeat_is_applied_in_the_callback_and_wakes_no_reader(
        pair: tuple[WorkerChannel, socket.socket]) -> None:
    channel, theirs = pair
    rank = Rank(rank=1, attempt=1, state=RankState.TRAINING)
    clock = RealClock()
    budget = FrameBudget(100.0, 100.0, clock.monotonic())
    woken: list[WorkerMessage] = []
    seen = anyio.Event()

    async def read() -> None:
        async for m in channel.frames(quick=heartbeat_applier(rank, clock, budget)):
            woken.append(m)
            seen.set()

    with anyio.fail_after(WAIT):
        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            await anyio.wait_all_tasks_blocked()
            for step in (1, 2, 3):
                theirs.sendall(hb(step))
                while rank.step != step:  # applied by the loop's callback, the reader asleep
                    await anyio.lowlevel.checkpoint()
            assert woken == [] and rank.last_frame is not None and budget.count == 3
            theirs.sendall(b'{"type":"progress","step":4,"loss":0.25}\n')  # anything else wakes it
            await seen.wait()
            assert [type(m) for m in woken] == [Progress]
            tg.cancel_scope.cancel()


async def test_a_heartbeat_over_the_budget_or_out_of_range_goes_to_the_reader(
        pair: tuple[WorkerChannel, socket.socket]) -> None:
    channel, theirs = pair
    rank = Rank(rank=0, attempt=1, state=RankState.TRAINING)
    clock = RealClock()
    budget = FrameBudget(1.0, 1.0, clock.monotonic())  # one frame, then empty for a second
    theirs.sendall(hb(1) + hb(2) + b'{"type":"hb","step":-1}\n')
    theirs.close()
    with anyio.fail_after(WAIT):
        got = [m async for m in channel.frames(quick=heartbeat_applier(rank, clock, budget))]
    # the first was applied by the callback; the second found no token; the third has no valid step
    assert rank.step == 1
    assert [getattr(m, "step", None) for m in got] == [2, -1]


async def test_frames_after_a_queued_one_keep_their_order(pair: tuple[WorkerChannel, socket.socket]) -> None:
    """A heartbeat behind a frame not yet taken is queued behind it, never applied before it."""
    channel, theirs = pair
    rank = Rank(rank=0, attempt=1, state=RankState.TRAINING)
    clock = RealClock()
    budget = FrameBudget(100.0, 100.0, clock.monotonic())
    theirs.sendall(b'{"type":"phase","phase":"training"}\n' + hb(7))
    theirs.close()
    with anyio.fail_after(WAIT):
        got = [m async for m in channel.frames(quick=heartbeat_applier(rank, clock, budget))]
    assert [type(m) for m in got] == [PhaseChanged, Heartbeat] and rank.step == 0


async def test_a_bad_frame_raises_in_its_place(pair: tuple[WorkerChannel, socket.socket]) -> None:
    channel, theirs = pair
    theirs.sendall(hb(1) + b"{not json\n" + hb(2))
    got: list[WorkerMessage] = []

    async def read() -> None:
        async for m in channel.frames():
            got.append(m)

    with anyio.fail_after(WAIT), pytest.raises(FrameError, match="malformed JSON"):
        await read()
    assert [getattr(m, "step", None) for m in got] == [1]
    with anyio.fail_after(WAIT):  # the frames behind it are still there for a reader that goes on
        async for m in channel.frames():
            assert getattr(m, "step", None) == 2
            break


async def test_the_queue_is_bounded_and_reading_resumes_once_it_is_taken(
        pair: tuple[WorkerChannel, socket.socket]) -> None:
    """A worker that writes more than the reader takes waits on its own send: past QUEUE_LIMIT
    frames the daemon reads no more until the reader has taken them (a reader that awaits between
    frames, as a journal write does, lets the loop's callback run each time)."""
    channel, theirs = pair
    total = 20_000  # 450 kB: more than the socket's buffers, many reads
    payload = b"".join(hb(i) for i in range(total))
    most_held = 0
    with anyio.fail_after(WAIT):
        async with anyio.create_task_group() as tg:
            async def write() -> None:
                await anyio.to_thread.run_sync(theirs.sendall, payload)

            tg.start_soon(write)
            got = 0
            async for m in channel.frames():
                assert getattr(m, "step", None) == got
                got += 1
                most_held = max(most_held, len(channel._queue))
                await anyio.lowlevel.checkpoint()
                if got == total:
                    break
    # at most the limit plus what one read brought; without the limit it held thousands more
    assert most_held <= QUEUE_LIMIT + READ_SIZE // len(hb(0))


async def test_close_wakes_a_waiting_reader(pair: tuple[WorkerChannel, socket.socket]) -> None:
    channel, _ = pair
    with anyio.fail_after(WAIT):
        async with anyio.create_task_group() as tg:
            ended = anyio.Event()

            async def read() -> None:
                async for _ in channel.frames():
                    pass
                ended.set()

            tg.start_soon(read)
            await anyio.wait_all_tasks_blocked()
            channel.close()
            await ended.wait()
