"""A simulated worker: speaks ddpd's worker protocol without torch (for the daemon-at-scale benchmark).

The daemon runs it in place of ``python -m ddpd.worker`` when its config sets
``worker_command = [python, ".../benchmarks/simworker.py"]``; it gets the same arguments
(``--fd N --parent PID [--pool]``). It says hello, waits for its assignment, reports the phases
up to ``training`` (without connecting to the store), then sends a Heartbeat carrying a step
counter every heartbeat interval (one step per beat) and a Progress frame every
``--progress-every`` beats. It ends on Stop (Result with ``stopped_early``, exit 0) and exits at
once when its channel closes or its parent dies (PR_SET_PDEATHSIG).

Run as a file, not a module: it must not import the benchmarks package (or torch).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import platform
import select
import signal
import socket
import sys
import time

from ddpd.protocol import PROTOCOL_VERSION, Decoder, LineSplitter, encode
from ddpd.protocol.channel import Assign, DaemonMessage, Heartbeat, Hello, PhaseChanged, Progress, Result, Stop

PR_SET_PDEATHSIG = 1


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--fd", type=int, required=True)
    p.add_argument("--parent", type=int, required=True)
    p.add_argument("--pool", action="store_true")
    p.add_argument("--progress-every", type=int, default=int(os.environ.get("SIMWORKER_PROGRESS_EVERY", "10")))
    args = p.parse_args()
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != args.parent:
        os._exit(70)
    sock = socket.socket(fileno=args.fd)
    sock.setblocking(True)
    splitter = LineSplitter()
    decoder: Decoder[DaemonMessage] = Decoder(DaemonMessage)

    poller = select.poll()  # not select(): the inherited fd is often above 1024 in a busy daemon
    poller.register(sock, select.POLLIN)

    def receive(timeout: float | None) -> list[DaemonMessage] | None:
        """Frames that arrived within `timeout`; None when the channel closed."""
        if not poller.poll(None if timeout is None else max(0, int(timeout * 1000) + 1)):
            return []
        data = sock.recv(65536)
        if not data:
            return None
        return [decoder.decode_frame(line) for line in splitter.feed(data)]

    sock.sendall(encode(Hello(version=PROTOCOL_VERSION, pid=os.getpid(), python=platform.python_version())))
    assign: Assign | None = None
    while assign is None:
        frames = receive(None)
        if frames is None:
            os._exit(71)
        for frame in frames:
            if isinstance(frame, Assign):
                assign = frame
    if assign.pgid > 0 and os.getpgrp() != assign.pgid:
        os.setpgid(0, assign.pgid)
    for phase in ("store_connected", "joined", "training"):
        sock.sendall(encode(PhaseChanged(phase=phase)))
    interval = assign.heartbeat_interval
    step = 0
    next_beat = time.monotonic()
    while True:
        now = time.monotonic()
        if now >= next_beat:
            step += 1
            sock.sendall(encode(Heartbeat(step=step)))
            if args.progress_every and step % args.progress_every == 0:
                sock.sendall(encode(Progress(step=step, loss=1.0 / step)))
            next_beat += interval
            continue
        frames = receive(next_beat - now)
        if frames is None:
            os._exit(71)
        if any(isinstance(f, Stop) for f in frames):
            sock.sendall(encode(Result(steps=step, stopped_early=True)))
            sys.stdout.flush()
            os._exit(0)


if __name__ == "__main__":
    main()
