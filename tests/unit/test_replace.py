"""Hot rank replacement: the daemon's decision, the ranks' side of the re-form, and what status shows."""

from __future__ import annotations

import io
import queue
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from ddpd.cli.render import ranks_table
from ddpd.daemon.attempt.events import Reformed
from ddpd.daemon.attempt.ranks import NOT_ALLOWED, RankHandle, RankLink, _apply
from ddpd.daemon.attempt.replace import Replacements
from ddpd.daemon.pool.channel import WorkerChannel
from ddpd.daemon.store.bus import EventBus
from ddpd.daemon.store.journal import Journal
from ddpd.daemon.store.records import Job, Rank
from ddpd.daemon.store.state import StateDB
from ddpd.protocol import JobState, RankState
from ddpd.protocol.channel import Failure, PhaseChanged, Result
from ddpd.protocol.spec import DEFAULT_HOT_REPLACE, JobSpec, SpecError, check_spec, hot_replacements
from ddpd.worker import reform
from ddpd.worker.loop import batch_source
from ddpd.worker.tasks import Task, TaskContext


@pytest.fixture
def handles() -> Iterator[list[RankHandle]]:
    """Two ranks' handles around a real (exited) process and a real channel each."""
    made: list[tuple[subprocess.Popen[bytes], socket.socket, socket.socket]] = []
    out = []
    for r in range(2):
        proc = subprocess.Popen([sys.executable, "-c", "pass"])
        proc.wait(timeout=30)
        a, b = socket.socketpair()
        made.append((proc, a, b))
        out.append(RankHandle(rank=Rank(rank=r, attempt=1, state=RankState.TRAINING), proc=proc,
                              channel=WorkerChannel(a)))
    yield out
    for _, a, b in made:
        a.close()
        b.close()


def job_of(**spec: Any) -> Job:
    return Job(id="j1", seq=1, name="", owner_uid=0, spec=JobSpec(nproc=2, **spec), state=JobState.RUNNING,
               submitted_at=0.0)


def test_a_task_job_allows_three_replacements_by_default_and_scripts_none() -> None:
    assert hot_replacements(check_spec(JobSpec(task="two-layer"))) == DEFAULT_HOT_REPLACE == 3
    assert hot_replacements(JobSpec(task="two-layer", hot_replace=0)) == 0
    assert hot_replacements(JobSpec(script=["train.py"])) == 0
    assert hot_replacements(JobSpec(task="two-layer", nnodes="2", rdzv_endpoint="h:1")) == 0  # across nodes: asked
    multi = check_spec(JobSpec(task="two-layer", hot_replace=2, nnodes="2", rdzv_endpoint="h:1", rdzv_id="r"))
    assert hot_replacements(multi) == 2
    with pytest.raises(SpecError, match="hot_replace: applies to built-in tasks"):
        check_spec(JobSpec(script=["train.py"], hot_replace=1))


def test_a_rank_lost_while_training_is_replaced_within_the_jobs_budget(handles: list[RankHandle]) -> None:
    job = job_of(task="two-layer", hot_replace=2)
    reps = Replacements(job, store_host_rank=0)
    r1 = handles[1]
    assert reps.refusal(r1, concluded=False, signalled=False) is None
    first = reps.begin(r1, now=1.0)
    assert (first.generation, job.hot_replaced, reps.lost) == (1, 1, [r1])
    # a second loss while the first re-forms: more than one rank at once
    assert "still being replaced" in (reps.refusal(r1, concluded=False, signalled=False) or "")
    reps.under_way = None
    assert reps.begin(r1, now=2.0).generation == 2
    reps.under_way = None
    assert reps.refusal(r1, concluded=False, signalled=False) == "the job's 2 hot replacement(s) are used"


@pytest.mark.parametrize(("change", "why"), [
    ({"rank": 0}, "serves the attempt's store"),
    ({"state": RankState.JOINED}, "lost before training"),
    ({"finished": True}, "had finished its work"),
    ({"result": Result(steps=3)}, "had finished its work"),
    ({"concluded": True}, "daemon was stopping"),
    ({"signalled": True}, "daemon was stopping"),
    ({"hot_replace": 0}, NOT_ALLOWED),
])
def test_what_is_never_replaced(handles: list[RankHandle], change: dict[str, Any], why: str) -> None:
    job = job_of(task="two-layer", hot_replace=change.get("hot_replace"))
    reps = Replacements(job, store_host_rank=0)
    h = handles[0] if change.get("rank") == 0 else handles[1]
    h.rank.state = change.get("state", RankState.TRAINING)
    h.finished = change.get("finished", False)
    h.result = change.get("result")
    refusal = reps.refusal(h, concluded=change.get("concluded", False), signalled=change.get("signalled", False))
    assert refusal is not None and why in refusal, refusal


def test_a_failure_that_a_replacement_already_redid_is_not_replaced_again(handles: list[RankHandle]) -> None:
    job = job_of(task="two-layer")
    reps = Replacements(job, store_host_rank=0)
    h = handles[1]
    h.failure = Failure(error="MemoryError", message="out of memory", traceback="", phase="training")
    assert reps.refusal(h, concluded=False, signalled=False) is None
    reps.begin(h, now=0.0)
    reps.under_way = None
    refusal = reps.refusal(h, concluded=False, signalled=False)
    assert refusal is not None and "repeat the same failure (MemoryError: out of memory)" in refusal


@pytest.mark.anyio
async def test_a_replacement_trains_once_it_re_formed_so_its_own_loss_is_replaced(
        handles: list[RankHandle], tmp_path: Path) -> None:
    """Bug (CI, the chaos test of tests/integration/test_hot_replace.py): a replacement counted as
    training only at its first progress report or its `training` phase, both after it rebuilt DDP;
    lost between the group's re-form (`rank.replaced`) and then, it was refused as lost before
    training, and the attempt failed."""
    job = job_of(task="two-layer", hot_replace=3)
    db = StateDB(tmp_path / "ddpd.db")
    journal = Journal(db, EventBus())
    await journal.create_job(job)
    send, receive = anyio.create_memory_object_stream[Any](10)
    ctx = RankLink(job=job, journal=journal, number=1, clock=None, frame_rate=100.0,  # type: ignore[arg-type]
                   events=send, signals=frozenset(), rdzv=None, assignment=lambda h: None)  # type: ignore[arg-type]
    new = handles[1]
    new.rank.state = RankState.JOINED  # a replacement: joined the new generation's group
    reps = Replacements(job, store_host_rank=0)
    assert "lost before training" in (reps.refusal(new, concluded=False, signalled=False) or "")
    await _apply(new, ctx, PhaseChanged(phase="reformed", generation=1), now=1.0)
    assert new.rank.state is RankState.TRAINING
    assert reps.refusal(new, concluded=False, signalled=False) is None
    assert isinstance(receive.receive_nowait(), Reformed)  # and the attempt is told, as before
    send.close()
    receive.close()
    db.close()


def test_every_rank_re_formed_ends_the_wait_and_only_the_replacement_makes_it_ready(
        handles: list[RankHandle]) -> None:
    job = job_of(task="two-layer")
    reps = Replacements(job, store_host_rank=0)
    r0, r1 = handles
    r = reps.begin(r1, now=10.0)
    new = RankHandle(rank=Rank(rank=1, attempt=1), proc=r1.proc, channel=r1.channel)  # rank 1 again, a new handle
    reps.connected(r0, now=10.5)  # a survivor
    reps.connected(r1, now=10.5)  # the lost rank itself
    assert not r.ready.is_set() and r.replacement is None
    reps.connected(new, now=10.25)
    assert r.ready.is_set() and r.ready_at == 10.25 and r.replacement is new
    reps.on_reformed(r0, now=10.4, nproc=2, generation=1)
    assert not r.done.is_set()
    reps.on_reformed(new, now=10.5, nproc=2, generation=1)
    assert r.done.is_set() and r.joined_at == 10.5


def test_a_generation_begun_on_another_node_comes_before_this_nodes_next(handles: list[RankHandle]) -> None:
    """Across nodes each daemon replaces its own ranks: its ranks' re-forms tell it the generations
    another node's daemon began, so its next one is after them (the store prefixes never collide)."""
    reps = Replacements(job_of(task="two-layer", hot_replace=3), store_host_rank=None)
    reps.on_reformed(handles[0], now=1.0, nproc=2, generation=4)  # nothing under way here: only learnt
    assert reps.under_way is None and reps.generation == 4
    assert reps.begin(handles[1], now=2.0).generation == 5


def test_status_shows_replacements_once_a_rank_was_replaced() -> None:
    job = job_of(task="two-layer")
    job.ranks = [Rank(rank=0, attempt=1), Rank(rank=1, attempt=1, replacements=2)]
    from rich.console import Console

    console = Console(file=io.StringIO(), width=200)
    console.print(ranks_table(job.view()))
    text = console.file.getvalue()  # type: ignore[attr-defined]
    assert "replaced" in text and "2x" in text
    job.ranks[1].replacements = 0
    console = Console(file=io.StringIO(), width=200)
    console.print(ranks_table(job.view()))
    assert "replaced" not in console.file.getvalue()  # type: ignore[attr-defined]


# -- the ranks' side -------------------------------------------------------------------------------


def test_only_a_broken_group_is_a_lost_peer() -> None:
    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:44750: "
                        "Connection reset by peer")
    assert reform.peer_lost(gloo)
    assert reform.peer_lost(RuntimeError("NCCL communicator was aborted on rank 1"))
    assert not reform.peer_lost(RuntimeError("mat1 and mat2 shapes cannot be multiplied (8x3 and 4x4)"))
    assert not reform.peer_lost(ValueError("gloo"))  # not a RuntimeError of a collective


class _Runtime:
    def __init__(self) -> None:
        self.reforms: queue.Queue[int] = queue.Queue()
        self.stop_requested = threading.Event()


def test_a_survivor_takes_the_newest_generation_or_fails_naming_the_lost_peer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rt: Any = _Runtime()
    rt.reforms.put(1)
    rt.reforms.put(2)  # a second loss before this rank looked
    assert reform.wait_reform(rt, 0, "peer gone") == 2
    rt.reforms.put(2)  # an old one is not a new generation
    monkeypatch.setattr(reform, "REFORM_WAIT", 0.2)
    with pytest.raises(reform.PeerLost, match=r"peer gone .*no re-form within"):
        reform.wait_reform(rt, 2, "peer gone")
    rt.stop_requested.set()  # the daemon gave up: no waiting out the bound
    monkeypatch.setattr(reform, "REFORM_WAIT", 60)
    with pytest.raises(reform.PeerLost):
        reform.wait_reform(rt, 2, "peer gone")


def test_a_re_formed_group_sees_the_batches_an_uninterrupted_run_sees() -> None:
    """The DataLoader path resumes at the exact batch (not the start of its epoch)."""
    data = torch.utils.data.TensorDataset(torch.arange(40, dtype=torch.float32).reshape(20, 2))
    task = Task(model=torch.nn.Linear(2, 1), loss=lambda out, b: out.sum(), dataset=data, batch_size=2)
    ctx = TaskContext(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"), steps=10, seed=3,
                      options={})
    whole = batch_source(task, ctx, 0)
    expected = [next(whole)[0].tolist() for _ in range(12)]  # 5 batches per epoch per rank: into epoch 3
    for first in (0, 3, 5, 7):
        resumed = batch_source(task, ctx, first)
        assert [next(resumed)[0].tolist() for _ in range(12 - first)] == expected[first:]
