"""A simulated worker: speaks ddpd's worker protocol without torch (for the daemon-at-scale benchmark).

The daemon runs it in place of ``python -m ddpd.worker`` when its config sets
``worker_command = [python, "-S", ".../benchmarks/simworker.py", "--protocol", N]``; it gets the
same arguments after those (``--fd N --parent PID [--pool]``). It says hello, waits for its
assignment, reports the phases up to ``training`` (without connecting to the store), then sends a
Heartbeat carrying a step counter every heartbeat interval (one step per beat) and a Progress frame
every ``SIMWORKER_PROGRESS_EVERY`` beats (10). It ends on Stop (Result with ``stopped_early``, exit
0) and exits at once when its channel closes or its parent dies (PR_SET_PDEATHSIG).

It stands in for a worker so that the benchmark measures the daemon, not interpreters starting:
it imports only what the interpreter has built in (no ddpd, no json, no socket: about a tenth of
``import ddpd.protocol``'s start-up), writes its frames itself and reads the two fields of its
Assign it needs (`tests/unit/test_simworker.py` holds them to the protocol's own types).

Run as a file, not a module: it must not import the benchmarks package (or torch).
"""

from __future__ import annotations

import os
import select
import sys
import time

PR_SET_PDEATHSIG = 1
SIGKILL = 9


def hello(version: int, pid: int) -> bytes:
    python = ".".join(str(v) for v in sys.version_info[:3])
    return b'{"type":"hello","version":%d,"pid":%d,"python":"%s"}\n' % (version, pid, python.encode())


def phase(name: str) -> bytes:
    return b'{"type":"phase","phase":"%s"}\n' % name.encode()


def heartbeat(step: int) -> bytes:
    return b'{"type":"hb","step":%d}\n' % step


def progress(step: int) -> bytes:
    return b'{"type":"progress","step":%d,"loss":%r}\n' % (step, 1.0 / step)


def result(steps: int) -> bytes:
    return b'{"type":"result","steps":%d,"stopped_early":true}\n' % steps


def frame_type(line: bytes) -> bytes:
    """The tag of a frame the daemon sent (msgspec writes it first)."""
    prefix = b'{"type":"'
    return line[len(prefix):line.find(b'"', len(prefix))] if line.startswith(prefix) else b""


def number(line: bytes, key: bytes) -> float:
    """A top-level number of an Assign: the last `"key":` in it (the spec and the environment come
    first, and a quote inside a string is escaped, so no string can end in `"key":`)."""
    at = line.rfind(b'"' + key + b'":')
    if at < 0:
        return 0.0
    start = at + len(key) + 3
    end = start
    while end < len(line) and line[end:end + 1] in b"0123456789.-+eE":
        end += 1
    return float(line[start:end])


def pdeathsig() -> None:
    import ctypes  # only here: it costs a few milliseconds of start-up

    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0)


def arg(argv: list[str], name: str, default: str | None = None) -> str:
    if name in argv:
        return argv[argv.index(name) + 1]
    if default is None:
        raise SystemExit(f"simworker: {name} is required")
    return default


class Channel:
    """The inherited socket, read and written as an fd (poll, not select: the fd is often above 1024)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buf = b""
        self.poller = select.poll()
        self.poller.register(fd, select.POLLIN)

    def send(self, data: bytes) -> None:
        while data:
            data = data[os.write(self.fd, data):]

    def receive(self, timeout: float | None) -> list[bytes] | None:
        """Whole lines that arrived within `timeout`; None when the channel closed."""
        if not self.poller.poll(None if timeout is None else max(0, int(timeout * 1000) + 1)):
            return []
        data = os.read(self.fd, 1 << 20)
        if not data:
            return None
        self.buf += data
        *lines, self.buf = self.buf.split(b"\n")
        return lines


def main() -> None:
    argv = sys.argv[1:]
    fd, parent = int(arg(argv, "--fd")), int(arg(argv, "--parent"))
    version = int(arg(argv, "--protocol"))
    every = int(os.environ.get("SIMWORKER_PROGRESS_EVERY", "10"))
    pdeathsig()
    if os.getppid() != parent:
        os._exit(70)
    os.set_blocking(fd, True)
    ch = Channel(fd)
    ch.send(hello(version, os.getpid()))
    assign = None
    while assign is None:
        lines = ch.receive(None)
        if lines is None:
            os._exit(71)
        assign = next((line for line in lines if frame_type(line) == b"assign"), None)
    pgid = int(number(assign, b"pgid"))
    if pgid > 0 and os.getpgrp() != pgid:
        os.setpgid(0, pgid)
    ch.send(b"".join(phase(p) for p in ("store_connected", "joined", "training")))
    interval = number(assign, b"heartbeat_interval") or 1.0
    step = 0
    next_beat = time.monotonic()
    while True:
        now = time.monotonic()
        if now >= next_beat:
            step += 1
            ch.send(heartbeat(step) + (progress(step) if every and step % every == 0 else b""))
            next_beat += interval
            continue
        lines = ch.receive(next_beat - now)
        if lines is None:
            os._exit(71)
        if any(frame_type(line) == b"stop" for line in lines):
            ch.send(result(step))
            os._exit(0)


if __name__ == "__main__":
    main()
