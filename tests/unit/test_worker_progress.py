"""A worker reports every step of a short run, then at most PROGRESS_RATE Progress frames a second."""

from __future__ import annotations

import os
import socket

from ddpd.protocol import Decoder, LineSplitter
from ddpd.protocol.channel import Progress, WorkerMessage
from ddpd.worker import runtime as rt


def test_progress_frames_are_bounded_but_the_step_is_always_recorded() -> None:
    ours, theirs = socket.socketpair()
    theirs.setblocking(False)
    runtime = rt.Runtime(rt.Channel(ours, os.getpgrp()))
    total = int(rt.PROGRESS_BURST) + 500
    for step in range(1, total + 1):  # far faster than PROGRESS_RATE: the burst, then little more
        runtime.progress(step, 1.0 / step)
    assert runtime.step == total
    splitter, decoder = LineSplitter(), Decoder(WorkerMessage)
    frames: list[WorkerMessage] = []
    while True:
        try:
            data = theirs.recv(1 << 16)
        except BlockingIOError:
            break
        frames += [decoder.decode_frame(line) for line in splitter.feed(data)]
    steps = [f.step for f in frames if isinstance(f, Progress)]
    assert steps[: int(rt.PROGRESS_BURST)] == list(range(1, int(rt.PROGRESS_BURST) + 1))
    assert len(steps) < total
    ours.close()
    theirs.close()


def _frames(sock: socket.socket) -> list[WorkerMessage]:
    splitter, decoder = LineSplitter(), Decoder(WorkerMessage)
    frames: list[WorkerMessage] = []
    while True:
        try:
            data = sock.recv(1 << 16)
        except BlockingIOError:
            return frames
        frames += [decoder.decode_frame(line) for line in splitter.feed(data)]


def test_counted_optimizer_steps_until_the_script_reports_its_own() -> None:
    ours, theirs = socket.socketpair()
    theirs.setblocking(False)
    runtime = rt.Runtime(rt.Channel(ours, os.getpgrp()))
    for _ in range(3):
        runtime.count_step()
    assert runtime.step == 3 and runtime.phase == "training"
    first = _frames(theirs)
    assert [type(f).__name__ for f in first] == ["PhaseChanged", "Progress", "Progress", "Progress"]
    runtime.report(100, 0.5)  # the script's own count wins from its first report on
    runtime.count_step()
    assert (runtime.step, runtime.loss) == (100, 0.5)
    assert [(f.step, f.loss) for f in _frames(theirs) if isinstance(f, Progress)] == [(100, 0.5)]
    ours.close()
    theirs.close()
