"""The scale benchmark's simulated worker (a bash script) run for real over a socketpair, this test
in the daemon's place: its frames are the protocol's, it reads its Assign right whatever the job put
in its strings and keys, it stops on Stop with its Result, and it leaves when its channel closes."""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddpd.protocol import PROTOCOL_VERSION, Decoder, JobSpec, LineSplitter, encode
from ddpd.protocol.channel import Assign, Heartbeat, Hello, PhaseChanged, Progress, Result, Stop, WorkerMessage

SIMWORKER = Path(__file__).resolve().parents[2] / "benchmarks" / "simworker.sh"
WAIT = 10.0


class Daemon:
    """This test's end of the channel."""

    def __init__(self, sock: socket.socket) -> None:
        sock.settimeout(WAIT)  # every read is bounded
        self.sock = sock
        self.splitter = LineSplitter()
        self.decoder: Decoder[WorkerMessage] = Decoder(WorkerMessage)
        self.lines: list[bytes] = []

    def frame(self) -> WorkerMessage:
        while not self.lines:
            data = self.sock.recv(65536)
            assert data, "the simulated worker closed its channel"
            self.lines += self.splitter.feed(data)
        return self.decoder.decode_frame(self.lines.pop(0))


@pytest.fixture
def worker() -> Iterator[tuple[Daemon, subprocess.Popen[bytes]]]:
    ours, theirs = socket.socketpair()
    proc = subprocess.Popen(["bash", str(SIMWORKER), "--protocol", str(PROTOCOL_VERSION), "--fd", str(theirs.fileno()),
                             "--parent", str(os.getpid())], pass_fds=[theirs.fileno()],
                            env={**os.environ, "SIMWORKER_PROGRESS_EVERY": "2"})
    theirs.close()
    try:
        yield Daemon(ours), proc
    finally:
        ours.close()
        if proc.poll() is None:
            proc.kill()
        proc.wait(WAIT)


def assign(pgid: int = 0) -> Assign:
    spec = JobSpec(name='x "pgid":5, "heartbeat_interval":30}', task="two-layer", nproc=2)
    return Assign(job_id="j1-abcd", attempt=1, rank=1, world_size=2, local_rank=1, local_world_size=2,
                  store_host="127.0.0.1", store_port=1, spec=spec, env={"pgid": "3", "heartbeat_interval": "8"},
                  heartbeat_interval=0.05, join_timeout=60.0, checkpoint_dir="/c", pgid=pgid)


def test_it_speaks_the_protocol_and_stops_on_stop(worker: tuple[Daemon, subprocess.Popen[bytes]]) -> None:
    d, proc = worker
    hello = d.frame()
    assert isinstance(hello, Hello) and (hello.version, hello.pid) == (PROTOCOL_VERSION, proc.pid)
    d.sock.sendall(encode(assign()))
    assert [d.frame() for _ in range(3)] == [PhaseChanged(phase=p) for p in ("store_connected", "joined", "training")]
    beats = [d.frame() for _ in range(3)]  # at 0.05 s: the interval was read from the Assign, not its strings
    assert beats == [Heartbeat(step=1), Heartbeat(step=2), Progress(step=2, loss=0.5)]
    d.sock.sendall(encode(Stop(reason="cancel")))
    while not isinstance(last := d.frame(), Result):
        assert isinstance(last, Heartbeat | Progress)
    assert last.stopped_early and last.steps >= 2
    assert proc.wait(WAIT) == 0


def test_it_leaves_when_its_channel_closes(worker: tuple[Daemon, subprocess.Popen[bytes]]) -> None:
    d, proc = worker
    assert isinstance(d.frame(), Hello)
    d.sock.close()
    assert proc.wait(WAIT) == 71


def test_it_refuses_a_process_group_to_join(worker: tuple[Daemon, subprocess.Popen[bytes]]) -> None:
    d, proc = worker
    assert isinstance(d.frame(), Hello)
    d.sock.sendall(encode(assign(pgid=4242)))
    assert proc.wait(WAIT) == 72
