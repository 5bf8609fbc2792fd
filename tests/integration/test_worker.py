"""The worker without the daemon: a real `python -m ddpd.worker` over a socketpair, a real TCPStore."""

from __future__ import annotations

import array
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch.distributed as dist

from ddpd.protocol import Decoder, JobSpec, LineSplitter, encode
from ddpd.protocol.channel import (
    Assign,
    Checkpointed,
    DumpStacks,
    Failure,
    Heartbeat,
    Hello,
    PhaseChanged,
    Progress,
    Release,
    Result,
    Stop,
    WorkerMessage,
)

from ..conftest import REPO

TIMEOUT = 60.0  # bound on any one wait (a cold `import torch` on a busy CI box takes seconds)


class Store:
    """The attempt's TCPStore server on a socket bound here, as the daemon hosts it."""

    def __init__(self, world_size: int) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port: int = self.sock.getsockname()[1]
        self.store = dist.TCPStore("127.0.0.1", self.port, world_size, is_master=True,
                                   master_listen_fd=self.sock.fileno(), wait_for_workers=False,
                                   timeout=timedelta(seconds=TIMEOUT))


class Worker:
    """One worker process and our end of its channel."""

    def __init__(self, log: Path, *extra: str, parent: int | None = None) -> None:
        ours, theirs = socket.socketpair()
        self.sock = ours
        self.log = log
        self.splitter = LineSplitter()
        self.decoder: Decoder[WorkerMessage] = Decoder(WorkerMessage)
        self.pending: list[WorkerMessage] = []
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ddpd.worker", "--fd", str(theirs.fileno()),
                 "--parent", str(os.getpid() if parent is None else parent), *extra],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                cwd=REPO, process_group=0,
            )
        theirs.close()

    def send(self, message: Any) -> None:
        self.sock.sendall(encode(message))

    def recv(self, deadline: float) -> WorkerMessage | None:
        """The next frame; None at EOF; TimeoutError past `deadline` (time.monotonic)."""
        while not self.pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.sock], [], [], left)[0]:
                raise TimeoutError(f"no frame from worker; log:\n{self.log.read_text()}")
            data = self.sock.recv(65536)
            if not data:
                return None
            self.pending += [self.decoder.decode_frame(line) for line in self.splitter.feed(data)]
        return self.pending.pop(0)

    def until(self, kind: type[Any] | tuple[type[Any], ...], timeout: float = TIMEOUT) -> list[WorkerMessage]:
        """Frames up to and including the first of `kind` (heartbeats included)."""
        deadline = time.monotonic() + timeout
        seen: list[WorkerMessage] = []
        while True:
            message = self.recv(deadline)
            if message is None:
                log = self.log.read_text()
                raise AssertionError(f"channel closed before {kind}; saw {seen}; log:\n{log}")
            seen.append(message)
            if isinstance(message, kind):
                return seen

    def wait(self, timeout: float = TIMEOUT) -> int:
        """Reap the worker and check that its whole process group is gone."""
        code = self.proc.wait(timeout)
        with pytest.raises(ProcessLookupError):
            os.kill(self.proc.pid, 0)
        assert live_members(self.proc.pid) == []
        self.sock.close()
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(TIMEOUT)
        self.sock.close()


def live_members(pgid: int) -> list[int]:
    """Pids of non-zombie processes in process group `pgid` (read from /proc)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:
            pids.append(int(entry))
    return pids


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Any]:
    workers: list[Worker] = []

    def make(*extra: str, parent: int | None = None) -> Worker:
        worker = Worker(tmp_path / f"rank{len(workers)}.log", *extra, parent=parent)
        workers.append(worker)
        return worker

    yield make
    for worker in workers:
        worker.kill()


def assignment(rank: int, world: int, store: Store, spec: JobSpec, ckpt: Path | None = None,
               pgid: int = 0) -> Assign:
    env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
           "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
           "OMP_NUM_THREADS": "1"}
    return Assign(job_id="job1", attempt=1, rank=rank, world_size=world, local_rank=rank,
                  local_world_size=world, store_host="127.0.0.1", store_port=store.port, spec=spec, env=env,
                  heartbeat_interval=0.2, join_timeout=TIMEOUT, checkpoint_dir=str(ckpt) if ckpt else "",
                  pgid=pgid)


def of(kind: type[Any], messages: list[WorkerMessage]) -> list[Any]:
    return [m for m in messages if isinstance(m, kind)]


def progress_steps(messages: list[WorkerMessage], first: int, last: int) -> list[int]:
    """The steps of the Progress frames, checked as the loop coalesces them: the attempt's first step,
    increasing, the last step always; fewer frames than steps when steps are fast."""
    steps = [m.step for m in of(Progress, messages)]
    assert steps and steps[0] == first and steps[-1] == last, steps
    assert steps == sorted(set(steps)), steps
    return steps


def test_single_rank_hello_phases_progress_result(spawn: Any) -> None:
    worker = spawn("--pool")
    hello = worker.until(Hello)[-1]
    assert isinstance(hello, Hello)
    assert hello.pid == worker.proc.pid
    assert hello.torch
    store = Store(1)
    worker.sock.sendall(b'{"type": "nonsense"}\nnot json\n')  # reported in the log and skipped
    worker.send(assignment(0, 1, store, JobSpec(task="two-layer", steps=5), pgid=worker.proc.pid))
    frames = worker.until(Result)
    phases = [m.phase for m in of(PhaseChanged, frames)]
    assert phases == ["store_connected", "joined", "training", "done"]
    progress_steps(frames, 1, 5)
    result = frames[-1]
    assert isinstance(result, Result)
    assert result.steps == 5
    assert result.checksum is not None
    assert not result.stopped_early
    assert worker.wait() == 0
    assert "ignoring bad frame" in worker.log.read_text()


def test_two_ranks_train_to_identical_checksums(spawn: Any) -> None:
    """Rank 1 joins rank 0's process group (pool-style pgid) and both end with equal parameters."""
    workers = [spawn(), spawn()]
    for w in workers:
        w.until(Hello)
    store = Store(2)
    spec = JobSpec(task="two-layer", steps=20, seed=3)
    workers[0].send(assignment(0, 2, store, spec))
    workers[1].send(assignment(1, 2, store, spec, pgid=workers[0].proc.pid))
    results = []
    for w in workers:
        frames = w.until(Result)
        progress_steps(frames, 1, 20)
        results.append(frames[-1])
    assert os.getpgid(workers[1].proc.pid) == workers[0].proc.pid
    assert results[0].checksum == results[1].checksum
    assert [w.proc.wait(TIMEOUT) for w in workers] == [0, 0]
    for w in workers:
        w.wait()


def test_closed_channel_kills_the_worker(spawn: Any) -> None:
    worker = spawn()
    worker.until(Hello)
    worker.sock.shutdown(socket.SHUT_RDWR)
    assert worker.wait() == -signal.SIGKILL


def test_closed_channel_during_training_kills_the_group(spawn: Any) -> None:
    worker = spawn()
    worker.until(Hello)
    store = Store(1)
    spec = JobSpec(task="tests.tasks:slow", steps=10_000, options={"step_sleep": 0.01})
    worker.send(assignment(0, 1, store, spec))
    frames = worker.until(Progress)
    worker.until(Heartbeat)
    assert of(PhaseChanged, frames)[-1].phase == "training"
    worker.sock.shutdown(socket.SHUT_RDWR)
    assert worker.wait() == -signal.SIGKILL


def test_wrong_parent_exits_at_once(spawn: Any) -> None:
    worker = spawn(parent=1)
    assert worker.wait() == 70


def test_failure_carries_traceback_and_phase(spawn: Any) -> None:
    worker = spawn()
    worker.until(Hello)
    store = Store(1)
    spec = JobSpec(task="tests.tasks:fail_at_step", steps=10, options={"rank": 0, "at_step": 3})
    worker.send(assignment(0, 1, store, spec))
    frames = worker.until(Failure)
    failure = frames[-1]
    assert isinstance(failure, Failure)
    assert (failure.error, failure.message, failure.phase) == ("RuntimeError", "injected failure", "training")
    assert "fail_at_step" in failure.traceback or "on_step" in failure.traceback
    assert "bootstrap.py" not in failure.traceback  # it starts at the task's own frame ...
    assert [m.step for m in of(Progress, frames)] in ([1], [1, 2])
    assert worker.wait() == 1
    log = worker.log.read_text()
    assert "injected failure" in log and "bootstrap.py" in log  # ... and the log keeps every frame


def test_stop_checkpoints_and_the_next_attempt_resumes(spawn: Any, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    spec = JobSpec(task="tests.tasks:slow", steps=10_000, options={"step_sleep": 0.01})
    worker = spawn()
    worker.until(Hello)
    store = Store(1)  # kept referenced: the server lives as long as the Python object
    worker.send(assignment(0, 1, store, spec, ckpt))
    worker.until(Progress)
    worker.send(DumpStacks())
    worker.send(Stop(reason="test"))
    frames = worker.until(Result)
    result = frames[-1]
    assert isinstance(result, Result)
    assert result.stopped_early
    saved = of(Checkpointed, frames)
    assert saved
    assert saved[-1].step == result.steps
    assert Path(saved[-1].path) == ckpt / "checkpoint.pt"
    assert [m.phase for m in of(PhaseChanged, frames)][-2:] == ["stopping", "done"]
    assert worker.wait() == 0
    assert "Thread" in worker.log.read_text()  # faulthandler's dump, written on DumpStacks

    again = spawn()
    again.until(Hello)
    resume = JobSpec(task="two-layer", steps=result.steps + 2)
    store = Store(1)  # a new store per attempt
    again.send(assignment(0, 1, store, resume, ckpt))
    frames = again.until(Result)
    assert [m.step for m in of(Progress, frames)] == [result.steps + 1, result.steps + 2]
    assert again.wait() == 0


SCRIPT = """
import sys
import torch
import torch.distributed as dist
from ddpd.worker import api

dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
api.report(1, loss=float(t.item()))
assert sys.argv[1:] == ["--flag", "x"], sys.argv
sys.exit(0)
"""


def test_script_mode_reports_join_progress_and_result(spawn: Any, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    worker = spawn()
    worker.until(Hello)
    store = Store(1)
    message = assignment(0, 1, store, JobSpec(script=[str(script), "--flag", "x"]))
    message.env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    worker.send(message)
    frames = worker.until((Result, Failure))
    assert isinstance(frames[-1], Result), frames[-1]
    assert [m.phase for m in of(PhaseChanged, frames)] == ["store_connected", "joined", "training", "done"]
    assert frames[-1].steps == 1
    assert frames[-1].loss == 1.0
    assert worker.wait() == 0


def test_dataset_task_with_gradient_accumulation(spawn: Any) -> None:
    workers = [spawn(), spawn()]
    for w in workers:
        w.until(Hello)
    store = Store(2)
    spec = JobSpec(task="tests.tasks:regression", steps=12, options={"accumulate": 2, "bf16": True})
    for rank, w in enumerate(workers):
        w.send(assignment(rank, 2, store, spec))
    frames = [w.until(Result) for w in workers]
    assert frames[0][-1].checksum == frames[1][-1].checksum
    progress_steps(frames[0], 1, 12)
    losses = [m.loss for m in of(Progress, frames[0])]
    assert losses[-1] < losses[0]  # it learns
    assert [w.wait() for w in workers] == [0, 0]


def test_stuck_rank_heartbeats_dumps_stacks_and_dies_with_its_group(spawn: Any) -> None:
    """A rank stuck in Python keeps heartbeating with a frozen step; its stack dump shows where it is;
    when its channel closes, its whole process group (its peer too) is killed."""
    workers = [spawn(), spawn()]
    for w in workers:
        w.until(Hello)
    store = Store(2)
    spec = JobSpec(task="tests.tasks:hang_in_training", steps=100, options={"rank": 1, "at_step": 3})
    workers[0].send(assignment(0, 2, store, spec))
    workers[1].send(assignment(1, 2, store, spec, pgid=workers[0].proc.pid))
    frames = workers[1].until(Heartbeat)
    while not (isinstance(frames[-1], Heartbeat) and frames[-1].step == 2):
        frames = workers[1].until(Heartbeat)
    beats = [workers[1].until(Heartbeat)[-1] for _ in range(2)]
    assert [b.step for b in beats if isinstance(b, Heartbeat)] == [2, 2]
    workers[1].send(DumpStacks())
    workers[1].sock.shutdown(socket.SHUT_WR)  # the reader handles the dump, then sees EOF
    assert workers[1].proc.wait(TIMEOUT) == -signal.SIGKILL
    assert workers[0].proc.wait(TIMEOUT) == -signal.SIGKILL
    for w in workers:
        w.wait()
    assert "in on_step" in workers[1].log.read_text()


class Bound:
    """The attempt's port bound here, as the daemon binds it: no store on it (rank 0 serves one)."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port: int = self.sock.getsockname()[1]


def test_rank_0_serves_the_store_on_the_passed_socket_until_released(spawn: Any) -> None:
    """The listening socket comes with rank 0's Assign (SCM_RIGHTS) and the sender's copy is closed:
    rank 1 reaches the store rank 0 serves; rank 0 keeps serving after its result until Release."""
    workers = [spawn(), spawn()]
    for w in workers:
        w.until(Hello)
    bound = Bound()
    spec = JobSpec(task="two-layer", steps=5, seed=3)
    first = msgspec.structs.replace(assignment(0, 2, bound, spec), serve_store=True)  # type: ignore[arg-type]
    rights = array.array("i", [bound.sock.fileno()]).tobytes()
    workers[0].sock.sendmsg([encode(first)], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, rights)])
    bound.sock.close()
    workers[1].send(assignment(1, 2, bound, spec, pgid=workers[0].proc.pid))  # type: ignore[arg-type]
    results = [w.until(Result)[-1] for w in workers]
    assert isinstance(results[0], Result) and isinstance(results[1], Result)
    assert results[0].checksum == results[1].checksum
    assert workers[1].proc.wait(TIMEOUT) == 0
    assert workers[0].proc.poll() is None  # its result sent, it still serves the store
    workers[0].send(Release())
    assert workers[0].proc.wait(TIMEOUT) == 0
    for w in workers:
        w.wait()
