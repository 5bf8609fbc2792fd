"""The built-in DDP training loop (task mode).

Order: resolve the device, build the task (before any rendezvous, so a task that hangs here is
a rank that never joins), connect to the attempt's TCPStore, ``init_process_group``, wrap the
model in DistributedDataParallel, resume from the last checkpoint, train with a periodic stop
vote, and finish with the parameter checksum and ``destroy_process_group``.

No host-device synchronisation per step: the loss stays on the device and is read only when a
Progress frame goes out (the first step of an attempt, then at most one every
`PROGRESS_MIN`..`PROGRESS_MAX` seconds, and always the last step), and the stop vote's
collective runs about every `StopVote.VOTE_INTERVAL` seconds, not every step. The heartbeat
thread carries the step counter in between, so the daemon's progress watch sees every step.

The process group's timeout (how long a collective may wait before the backend gives up) is
``DDPD_COLLECTIVE_TIMEOUT`` seconds, which the daemon sets for every job past its own hang
diagnosis (script mode passes it too, where the script gives none), else the join timeout.

A rank given GPUs (``gpus_per_rank`` > 0, device auto or cuda) on which torch finds no CUDA (a
CPU-only wheel, a driver mismatch) fails at once, naming the cause (`require_cuda`), rather than
training on the CPU while it holds GPUs.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ddpd.protocol.channel import Assign, Checkpointed, PhaseChanged, Progress, Result
from ddpd.protocol.spec import JobSpec

from . import reform
from .checkpoint import load_checkpoint, save_checkpoint
from .runtime import Runtime
from .tasks import Task, TaskContext, default_forward, resolve_factory, to_device

# set by the daemon's launch code (the same name is in ddpd.daemon.gpu.rankenv; daemon and worker share no module)
COLLECTIVE_TIMEOUT_ENV = "DDPD_COLLECTIVE_TIMEOUT"
PROGRESS_MIN, PROGRESS_MAX = 0.25, 1.0


def cuda_unavailable() -> str | None:
    """Why torch cannot use CUDA here (its build, the driver's complaint), or None when it can."""
    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is built without CUDA"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if torch.cuda.is_available():
            return None
    said = "; ".join(str(w.message).strip() for w in caught) or "no CUDA device is visible"
    return f"torch {torch.__version__} (CUDA {torch.version.cuda}) cannot use CUDA: {said}"


def require_cuda(spec: JobSpec) -> None:
    """A rank given GPUs must be able to use them (device=cpu is the job's explicit choice)."""
    if spec.gpus_per_rank <= 0 or spec.device == "cpu":
        return
    why = cuda_unavailable()
    if why is not None:
        raise RuntimeError(f"the daemon gave this rank GPUs (CUDA_VISIBLE_DEVICES="
                           f"{os.environ.get('CUDA_VISIBLE_DEVICES', '')!r}) but {why}")


def env_collective_timeout(environ: Mapping[str, str] = os.environ) -> float | None:
    """``DDPD_COLLECTIVE_TIMEOUT`` in seconds, None where it is unset or not a positive number."""
    try:
        seconds = float(environ.get(COLLECTIVE_TIMEOUT_ENV, ""))
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) and seconds > 0 else None


def resolve_device(spec: JobSpec, local_rank: int) -> Any:
    """CUDA when asked for (or `auto` with GPUs given or visible), else CPU."""
    require_cuda(spec)
    if spec.device == "auto":
        visible = spec.gpus_per_rank > 0 or "CUDA_VISIBLE_DEVICES" in os.environ
        use_cuda = visible and torch.cuda.is_available()
    else:
        use_cuda = spec.device == "cuda"
    if not use_cuda:
        return torch.device("cpu")
    if spec.gpus_per_rank > 0:  # the daemon gave this rank its own CUDA_VISIBLE_DEVICES
        return torch.device("cuda", 0)
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def resolve_backend(spec: JobSpec, device: Any) -> str:
    if spec.backend != "auto":
        return spec.backend
    return "nccl" if device.type == "cuda" else "gloo"


def run_task(runtime: Runtime, assign: Assign) -> Result:
    spec = assign.spec
    device = resolve_device(spec, assign.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ctx = TaskContext(rank=assign.rank, world_size=assign.world_size, local_rank=assign.local_rank,
                      device=device, steps=spec.steps, seed=spec.seed, options=dict(spec.options))
    task = resolve_factory(spec.task or "two-layer", spec.workdir)(ctx)
    connect(runtime, assign, resolve_backend(spec, device))
    return train(runtime, assign, task, ctx)


def collective_timeout(assign: Assign, environ: Mapping[str, str] = os.environ) -> float:
    """Seconds a collective may wait: ``DDPD_COLLECTIVE_TIMEOUT`` if set and valid, else the join timeout."""
    seconds = env_collective_timeout(environ)
    return assign.join_timeout if seconds is None else seconds


def connect(runtime: Runtime, assign: Assign, backend: str) -> None:
    """Connect to the daemon's store, then join the process group; each reported as a phase."""
    runtime.store = dist.TCPStore(assign.store_host, assign.store_port, assign.world_size,
                                  is_master=False, timeout=timedelta(seconds=assign.join_timeout))
    set_phase(runtime, "store_connected")
    if assign.generation > 0:  # a replacement: its generation's group, told to survivors on other nodes too
        reform.publish(runtime, assign.generation)
    reform.join(runtime, assign, backend, assign.generation, collective_timeout(assign))
    set_phase(runtime, "joined")


def set_phase(runtime: Runtime, phase: Any) -> None:
    runtime.phase = phase
    runtime.send(PhaseChanged(phase=phase))


def train(runtime: Runtime, assign: Assign, task: Task, ctx: TaskContext) -> Result:
    spec, device = assign.spec, ctx.device
    accumulate = max(1, int(ctx.options.get("accumulate", 1)))
    lr = float(ctx.options.get("lr", 0.01))
    model = task.model.to(device)
    optimizer = (task.optimizer or (lambda ps: torch.optim.SGD(ps, lr=lr)))(model.parameters())
    backend = dist.get_backend()
    small = device if backend == "nccl" else torch.device("cpu")  # where votes and counters live
    generation = assign.generation
    if generation > 0:  # a replacement: the group's state, not a checkpoint
        start = reform.share_state(model, optimizer, 0, device)
        reform.reformed(runtime, generation, start)
    else:
        start = load_checkpoint(assign.checkpoint_dir, model, optimizer, device)
        if assign.world_size != assign.local_world_size:  # across nodes: the newest checkpoint of any node
            start = newest_checkpoint(start, model, small)
    saved = start
    forward = task.forward or default_forward
    autocast: Any = contextlib.nullcontext
    if device.type == "cuda" and ctx.options.get("bf16"):
        autocast = lambda: torch.autocast("cuda", dtype=torch.bfloat16)  # noqa: E731
    reporter = ProgressReporter(runtime, progress_interval(assign.heartbeat_interval))

    def wrap(at: int) -> tuple[Any, Iterator[Any], StopVote]:
        """DDP, the batches and the stop vote for a group that starts (or starts again) at step `at`."""
        ddp = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
        return ddp, batch_source(task, ctx, at * accumulate), StopVote(runtime, small, at)

    def one_step(ddp: Any, data: Iterator[Any], step: int) -> None:
        if task.on_step is not None:
            task.on_step(step)
        optimizer.zero_grad(set_to_none=True)
        losses: list[Any] = []
        for micro in range(accumulate):
            batch = next(data)
            sync = ddp.no_sync() if micro < accumulate - 1 else contextlib.nullcontext()
            with sync:
                with autocast():
                    loss = task.loss(forward(ddp, batch), batch)
                (loss / accumulate if accumulate > 1 else loss).backward()
            losses.append(loss.detach())
        optimizer.step()
        reporter.stepped(step, losses, final=step >= spec.steps)

    ddp, data, vote = wrap(start)
    runtime.step = start
    set_phase(runtime, "training")
    step, stopped = start, False
    while step < spec.steps:
        try:
            if vote.agreed(step):
                stopped = True
                break
            one_step(ddp, data, step + 1)
        except Exception as exc:
            if not (assign.hot_replace and reform.peer_lost(exc)):
                raise
            why = f"{type(exc).__name__}: {exc}"
        else:
            step += 1
            if spec.checkpoint_every > 0 and step % spec.checkpoint_every == 0:
                saved = checkpoint(runtime, assign, model, optimizer, step)
            continue
        # a peer was lost: leave the broken group (the exception, and with it the step's frames, is gone)
        ddp = data = vote = None  # type: ignore[assignment]
        reform.leave()
        generation = reform.wait_reform(runtime, generation, why, assign.world_size != assign.local_world_size)
        reform.join(runtime, assign, backend, generation, collective_timeout(assign))
        step = reform.share_state(model, optimizer, step, device)
        ddp, data, vote = wrap(step)
        reform.reformed(runtime, generation, step)
        reporter.sent_at = None  # the first step after the re-form is reported at once

    reporter.flush()
    if stopped:
        set_phase(runtime, "stopping")
        if saved != step:
            checkpoint(runtime, assign, model, optimizer, step)
    checksum = sum(p.detach().double().sum().item() for p in ddp.module.parameters())
    runtime.keepalive += [ddp, model, optimizer, data, task]
    dist.destroy_process_group()
    return Result(steps=step, loss=runtime.loss, checksum=checksum, stopped_early=stopped)


def progress_interval(heartbeat_interval: float) -> float:
    """Seconds between Progress frames: the heartbeat interval, kept within PROGRESS_MIN..PROGRESS_MAX."""
    return min(PROGRESS_MAX, max(PROGRESS_MIN, heartbeat_interval))


def mean_loss(losses: Sequence[Any]) -> float:
    """The mean of one step's micro-batch losses as a float: the only point where the loss is read."""
    if len(losses) == 1:
        return float(losses[0].item())
    return float(torch.stack(list(losses)).float().mean().item())


class ProgressReporter:
    """Coalesced Progress frames: the first step, then at most one per `interval`, and the final step.

    `stepped` records the step (the heartbeat thread reports it) and keeps the step's losses as
    tensors; only a frame that goes out reads them (`read`, a host-device sync on CUDA), so a
    step that is not reported costs no synchronisation. `flush` reports the last step if it has
    not been, so a stopped run's last step is reported too.
    """

    def __init__(self, runtime: Runtime, interval: float, clock: Callable[[], float] = time.monotonic,
                 read: Callable[[Sequence[Any]], float] = mean_loss) -> None:
        self.runtime = runtime
        self.interval = interval
        self.clock = clock
        self.read = read
        self.sent_at: float | None = None
        self.sent_step: int | None = None
        self.step: int | None = None
        self.losses: Sequence[Any] = ()

    def stepped(self, step: int, losses: Sequence[Any], final: bool = False) -> None:
        self.runtime.step, self.step, self.losses = step, step, losses
        if final or self.sent_at is None or self.clock() - self.sent_at >= self.interval:
            self.flush()

    def flush(self) -> None:
        if self.step is None or self.step == self.sent_step:
            return
        self.runtime.loss = self.read(self.losses)
        self.runtime.send(Progress(step=self.step, loss=self.runtime.loss))
        self.sent_at, self.sent_step, self.losses = self.clock(), self.step, ()


class StopVote:
    """All ranks agree to stop at the same step: one rank asked to stop stops them all.

    A vote is an `all_reduce(MAX)` of [stop flag, steps until the next vote]. Each rank proposes
    enough steps to fill VOTE_INTERVAL seconds at its own pace; the maximum is what all ranks
    use, so they vote at the same steps, about every VOTE_INTERVAL seconds (every step when steps
    are slower than that) instead of paying a collective every step.
    """

    VOTE_INTERVAL = 0.25
    MAX_STEPS_BETWEEN = 1000

    def __init__(self, runtime: Runtime, device: Any, start: int) -> None:
        self.runtime = runtime
        self.device = device
        self.next_vote = start
        self.last_step = start
        self.last_time = time.monotonic()

    def agreed(self, step: int) -> bool:
        """Called before each step with the number of steps done."""
        if step < self.next_vote:
            return False
        now = time.monotonic()
        done = step - self.last_step
        propose = 1 if done <= 0 else math.ceil(self.VOTE_INTERVAL / max((now - self.last_time) / done, 1e-6))
        flag = torch.tensor([1 if self.runtime.stop_requested.is_set() else 0,
                             min(self.MAX_STEPS_BETWEEN, max(1, propose))], dtype=torch.int64, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        stop, steps = (int(v) for v in flag.tolist())
        self.next_vote, self.last_step, self.last_time = step + steps, step, now
        return bool(stop)


def newest_checkpoint(start: int, model: Any, device: Any) -> int:
    """The step every rank resumes from, across nodes: the newest checkpoint any rank loaded.

    Each node's local rank 0 keeps checkpoints in its own daemon's directory, so a node that joined
    later has none (or an older one). The lowest rank holding the newest sends its parameters to
    all (the optimizer's state stays each node's own: none where a node had no checkpoint)."""
    newest = torch.tensor([start], dtype=torch.int64, device=device)
    dist.all_reduce(newest, op=dist.ReduceOp.MAX)
    step = int(newest.item())
    holder = torch.tensor([dist.get_rank() if start == step else dist.get_world_size()], dtype=torch.int64,
                          device=device)
    dist.all_reduce(holder, op=dist.ReduceOp.MIN)
    if step > 0:
        for tensor in model.state_dict().values():
            dist.broadcast(tensor, src=int(holder.item()))
    return step


def checkpoint(runtime: Runtime, assign: Assign, model: Any, optimizer: Any, step: int) -> int:
    """Each node's local rank 0 writes the checkpoint (if the attempt has a checkpoint directory: its
    daemon's, so every node can resume) and reports it; on one node that is rank 0."""
    if assign.local_rank == 0 and assign.checkpoint_dir:
        path = save_checkpoint(assign.checkpoint_dir, model, optimizer, step)
        runtime.send(Checkpointed(step=step, path=path))
    return step


def batch_source(task: Task, ctx: TaskContext, first: int) -> Iterator[Any]:
    """Micro-batches from micro-batch index `first` on, on the rank's device (a resumed or re-formed
    group sees the batches an uninterrupted run would)."""
    if task.batches is not None:
        index = first
        while True:
            yield to_device(task.batches(index), ctx.device)
            index += 1
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    sampler = DistributedSampler(task.dataset, num_replicas=ctx.world_size, rank=ctx.rank,
                                 shuffle=True, seed=ctx.seed, drop_last=True)
    loader = DataLoader(task.dataset, batch_size=task.batch_size, sampler=sampler, drop_last=True,
                        pin_memory=ctx.device.type == "cuda")
    per_epoch = len(loader)
    if per_epoch == 0:
        raise ValueError("the task's dataset is too small for one batch per rank")
    epoch, skip = divmod(first, per_epoch)
    while True:
        sampler.set_epoch(epoch)
        # the batches of this epoch before `first` are drawn and dropped: the sampler's order (and
        # any random transform) stays the one an uninterrupted run sees
        for batch in itertools.islice(loader, skip, None):
            yield to_device(batch, ctx.device)
        epoch, skip = epoch + 1, 0
