"""Hot rank replacement, the ranks' side (built-in tasks, one node).

When a peer dies mid-training, the survivors' next collective fails (gloo: the peer's connection
closed; a rank blocked on a survivor learns it when that survivor leaves: `leave` drops the DDP
wrapper and destroys the group, closing its connections). Each survivor then waits, bounded by
REFORM_WAIT, for the daemon's Reform frame (`Runtime.reforms`); the daemon has started a
replacement with the dead rank's number. Every rank, survivors and replacement, joins the group of
the new generation on a prefix of the attempt's store (`join`), and the lowest rank sends its model,
optimizer state, step and RNG state to all (`share_state`): the step in flight when the group broke
is redone, never skipped nor counted twice, and survivors that disagreed on whether it finished
(ring all-reduce finishes on some ranks before others) all take the lowest rank's.

The state travels as `torch.save` bytes in a tensor broadcast and is read back with
`torch.load(weights_only=True)`: tensors and plain containers only, never a pickle of objects.
"""

from __future__ import annotations

import io
import queue
import re
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ddpd.protocol.channel import Assign, Heartbeat, PhaseChanged

from .runtime import Runtime

REFORM_WAIT = 15.0  # seconds a survivor waits for the daemon's Reform (the daemon gives up after 10)
# across nodes a survivor's own daemon knows nothing of a rank lost on another node: the replacement
# writes its generation here before it joins, and survivors read it as well as their Reform frames
GENERATION_KEY = "ddpd/reform/generation"
SOURCE = 0  # the rank whose state the re-formed group takes (the store's host: never the lost one)

# what a broken group looks like from a survivor (gloo's transport, NCCL, torch's own wrappers)
_PEER_LOST = re.compile(r"gloo|nccl|connection (closed|reset)|broken pipe|read error", re.IGNORECASE)


class PeerLost(RuntimeError):
    """The group broke and no Reform came: why the rank fails."""


def peer_lost(exc: BaseException) -> bool:
    """Did `exc` come from a collective whose group broke (not from the task's own code)?"""
    dist_error = getattr(dist, "DistError", ())
    return isinstance(exc, dist_error) or (isinstance(exc, RuntimeError) and bool(_PEER_LOST.search(str(exc))))


def store_prefix(generation: int) -> str:
    return f"ddpd/reform/{generation}/"


def group_store(runtime: Runtime, generation: int) -> Any:
    """The store the group of `generation` forms on: the attempt's store, under a prefix after the first."""
    return runtime.store if generation == 0 else dist.PrefixStore(store_prefix(generation), runtime.store)


def leave() -> None:
    """Destroy this rank's broken group (its connections close, so ranks blocked on it fail too)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def abort_nccl() -> None:
    """On the daemon's Reform (from the reader thread): NCCL does not notice a dead peer, so a survivor
    blocked in a collective is freed by aborting its communicator (gloo's transport fails by itself)."""
    try:
        if dist.is_initialized() and dist.get_backend() == "nccl":
            from torch.distributed.distributed_c10d import _abort_process_group

            _abort_process_group()
    except Exception as exc:  # an older torch, or a group already gone: the main thread's wait bounds it
        print(f"ddpd: could not abort the NCCL communicator: {exc!r}", file=sys.stderr, flush=True)


def publish(runtime: Runtime, generation: int) -> None:
    """A replacement says its generation in the attempt's store (for survivors on other nodes)."""
    runtime.store.set(GENERATION_KEY, str(generation))


def published(runtime: Runtime) -> int:
    """The newest generation a replacement wrote in the store (0: none)."""
    if not runtime.store.check([GENERATION_KEY]):
        return 0
    try:
        return int(runtime.store.get(GENERATION_KEY))
    except ValueError:
        return 0


def wait_reform(runtime: Runtime, generation: int, why: str, across_nodes: bool = False) -> int:
    """The newest generation named after `generation` (by this rank's daemon, or across nodes by a
    replacement, in the store); PeerLost if none comes in time or the daemon asks the rank to stop."""
    deadline = time.monotonic() + REFORM_WAIT
    newest = generation
    while True:
        try:
            while True:  # every Reform already here: a second loss names a later generation
                newest = max(newest, runtime.reforms.get_nowait())
        except queue.Empty:
            pass
        if across_nodes:
            newest = max(newest, published(runtime))
        if newest > generation:
            return newest
        left = deadline - time.monotonic()
        if left <= 0 or runtime.stop_requested.is_set():
            raise PeerLost(f"{why} (the group broke; the daemon sent no re-form within {REFORM_WAIT:.0f}s)")
        try:
            newest = max(newest, runtime.reforms.get(timeout=min(left, 0.1)))
        except queue.Empty:
            pass


def join(runtime: Runtime, assign: Assign, backend: str, generation: int, timeout: float) -> None:
    """Join the group of `generation` (same rank, same world size)."""
    dist.init_process_group(backend, store=group_store(runtime, generation), rank=assign.rank,
                            world_size=assign.world_size, timeout=timedelta(seconds=timeout))


def share_state(model: Any, optimizer: Any, step: int, device: Any) -> int:
    """Every rank takes SOURCE's model, optimizer state, step and RNG state; returns the step."""
    rank = dist.get_rank()
    if rank == SOURCE:
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                    "rng": torch.get_rng_state()}, buf)
        data = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8).to(device)
        size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    else:
        size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.broadcast(size, SOURCE)
    if rank != SOURCE:
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(data, SOURCE)
    if rank == SOURCE:
        return step
    state = torch.load(io.BytesIO(data.cpu().numpy().tobytes()), map_location=device, weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"].cpu())
    return int(state["step"])


def reformed(runtime: Runtime, generation: int, step: int) -> None:
    """Tell the daemon this rank trains again in `generation` from `step`."""
    runtime.step = step
    runtime.send(Heartbeat(step=step))  # the step it resumes at, read before the phase
    runtime.send(PhaseChanged(phase="reformed", detail=f"generation {generation} step {step}", generation=generation))
