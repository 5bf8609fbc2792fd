"""The channel to the daemon and the state shared by the worker's threads."""

from __future__ import annotations

import array
import os
import queue
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, NoReturn

from ddpd.protocol.agent import AgentReply
from ddpd.protocol.channel import DaemonMessage, PhaseChanged, Progress, WorkerMessage
from ddpd.protocol.framing import Decoder, FrameError, LineSplitter, encode
from ddpd.protocol.worker import EXIT_DAEMON_GONE

# Progress frames a rank sends at most: every step of a short run, then PROGRESS_RATE a second (the
# heartbeats carry the step counter too, and the daemon fails a rank that floods its channel). At 100
# a second a script's tiny model cost the daemon 6% of a core and each rank's reader thread 145
# wakeups a second (the daemon's reads wake it: one socket, one wait queue); at 10, 1% and 11.
PROGRESS_RATE = 10.0
PROGRESS_BURST = 200.0
MAX_PASSED_FDS = 4  # descriptors one read from the daemon may carry (it passes one: the store's socket)


class Channel:
    """The inherited socket to the daemon; every thread sends through `send` (one lock)."""

    def __init__(self, sock: socket.socket, daemon_pgid: int) -> None:
        self._sock = sock
        self._lock = threading.Lock()
        self._daemon_pgid = daemon_pgid
        self.fds: list[int] = []  # descriptors the daemon passed with its frames (SCM_RIGHTS), oldest first

    def send(self, message: WorkerMessage | AgentReply) -> None:
        data = encode(message)
        with self._lock:
            try:
                self._sock.sendall(data)
            except OSError as exc:
                self.daemon_gone(f"send failed: {exc}")

    def frames(self) -> Iterator[DaemonMessage]:
        """Daemon messages as they arrive; a bad frame is reported and skipped; ends at EOF."""
        splitter = LineSplitter()
        decoder: Decoder[DaemonMessage] = Decoder(DaemonMessage)
        while True:
            data = self.receive()
            if not data:
                return
            try:
                lines = splitter.feed(data)
            except FrameError as exc:
                _bad_frame(exc)
                continue
            for line in lines:
                try:
                    yield decoder.decode_frame(line)
                except FrameError as exc:
                    _bad_frame(exc)

    def receive(self) -> bytes:
        """The next bytes from the daemon, keeping any descriptors that came with them in `fds`."""
        data, ancillary, _, _ = self._sock.recvmsg(65536, socket.CMSG_SPACE(4 * MAX_PASSED_FDS))
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                passed = array.array("i")
                passed.frombytes(payload[: len(payload) - len(payload) % passed.itemsize])
                self.fds.extend(passed)
        return data

    def daemon_gone(self, why: str) -> NoReturn:
        """The daemon is gone: kill this worker's process group (its peers and children too).

        The group is never signalled when it is the daemon's own (a worker not yet moved to an
        attempt's group): then only this process exits.
        """
        try:
            print(f"ddpd worker {os.getpid()}: daemon gone ({why}); killing process group",
                  file=sys.stderr, flush=True)
        except Exception:
            pass
        pgrp = os.getpgrp()
        if pgrp != self._daemon_pgid:
            try:
                os.killpg(pgrp, signal.SIGKILL)
            except OSError:
                pass
        os._exit(EXIT_DAEMON_GONE)


def _bad_frame(exc: FrameError) -> None:
    print(f"ddpd worker: ignoring bad frame from daemon: {exc}", file=sys.stderr, flush=True)


class Runtime:
    """What the main, heartbeat and reader threads share.

    `step` and `loss` are written by the main thread only (plain attribute writes are atomic
    under the GIL) and read by the heartbeat thread; `phase` names where a failure happened.
    A script's steps are counted by `count_step` (its optimizer steps) until it calls `report`
    itself (`reported`): from then on only its reports move the counter.
    """

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.stop_requested = threading.Event()
        self.released = threading.Event()  # the store's host may leave (the daemon's Release)
        self.step = 0
        self.loss: float | None = None
        self.phase = "starting"
        self.reported = False
        # objects never to be freed before os._exit: destroying a DDP model after its process group
        # can block in native code, so the worker leaves without running those destructors
        self.keepalive: list[Any] = []
        self.store: Any = None  # the attempt's TCPStore client (a re-formed group takes a prefix of it)
        self.reforms: queue.Queue[int] = queue.Queue()  # generations the daemon's Reform frames named
        self.private_fds: list[int] = []  # the channel's and the store's: not its forked children's

        self._progress_tokens = PROGRESS_BURST
        self._progress_at = time.monotonic()

    def send(self, message: WorkerMessage) -> None:
        self.channel.send(message)

    def progress(self, step: int, loss: float | None) -> None:
        """Record that `step` is done and tell the daemon, unless that would exceed PROGRESS_RATE."""
        self.step, self.loss = step, loss
        now = time.monotonic()
        self._progress_tokens = min(PROGRESS_BURST, self._progress_tokens + (now - self._progress_at) * PROGRESS_RATE)
        self._progress_at = now
        if self._progress_tokens >= 1.0:
            self._progress_tokens -= 1.0
            self.send(Progress(step=step, loss=loss))

    def finished(self) -> None:
        """The task or script returned: tell the daemon once, before anything runs on the way out, so
        that a rank silent from now on is reported as stuck at exit, not in its work."""
        if self.phase != "done":
            self.phase = "done"
            self.send(PhaseChanged(phase="done"))

    def training(self) -> None:
        """The first step is done: tell the daemon (the progress timeout applies from now on)."""
        if self.phase != "training":
            self.phase = "training"
            self.send(PhaseChanged(phase="training"))

    def report(self, step: int, loss: float | None) -> None:
        """The script's own report (`api.report`): it wins over counted optimizer steps."""
        self.reported = True
        self.training()
        self.progress(step, loss)

    def count_step(self) -> None:
        """One optimizer step of a script that does not report its steps itself."""
        if self.reported:
            return
        self.training()
        self.progress(self.step + 1, self.loss)
