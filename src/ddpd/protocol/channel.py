"""Messages on the channel between the daemon and one worker (an inherited socketpair)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from .limits import TEXT_LIMIT
from .spec import JobSpec

Phase = Literal["store_connected", "joined", "training", "stopping", "done", "reformed"]

STACK_THREADS = 32  # threads one Stacks frame describes at most (the main thread first)
STACK_TEXT = TEXT_LIMIT  # characters of one thread's formatted stack (clipped head and tail)
THREAD_NAME = 256  # characters of a thread's name
RequestNumber = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]


class _W(msgspec.Struct, tag_field="type", forbid_unknown_fields=True):
    pass


# worker -> daemon


class Hello(_W, tag="hello"):
    """First frame of every worker: who it is, and what it runs with."""

    version: int
    pid: int
    python: str
    torch: str | None = None


class PhaseChanged(_W, tag="phase"):
    phase: Phase
    detail: str = ""
    generation: Annotated[int, msgspec.Meta(ge=0, le=10**6)] = 0  # "reformed": the group it re-formed in


class Heartbeat(_W, tag="hb"):
    """Sent from a background thread; `step` shows progress, the frame itself liveness."""

    step: int


class Progress(_W, tag="progress"):
    step: int
    loss: float | None = None


class Checkpointed(_W, tag="checkpointed"):
    step: int
    path: str


class Result(_W, tag="result"):
    """The rank finished its work; it exits 0 right after this frame."""

    steps: int
    loss: float | None = None
    checksum: float | None = None
    stopped_early: bool = False


class Failure(_W, tag="failure"):
    """The rank raised; it exits non-zero right after this frame."""

    error: str
    message: str
    traceback: str
    phase: str


class ThreadStack(msgspec.Struct, forbid_unknown_fields=True):
    """One thread's current stack, formatted as a traceback (innermost frame last)."""

    name: Annotated[str, msgspec.Meta(max_length=THREAD_NAME)]
    main: bool
    stack: Annotated[str, msgspec.Meta(max_length=STACK_TEXT)]


class Stacks(_W, tag="stacks"):
    """The answer to AskStacks: the stack of every thread (but the one answering), main first."""

    request: RequestNumber
    threads: Annotated[list[ThreadStack], msgspec.Meta(max_length=STACK_THREADS)]
    omitted: Annotated[int, msgspec.Meta(ge=0, le=2**31)] = 0  # threads left out (over STACK_THREADS)


class Forked(_W, tag="forked"):
    """A fork server's answer to `Fork`: the new process's pid (already the daemon's child, leading a
    session of its own; its Hello comes on the channel the request carried)."""

    pid: Annotated[int, msgspec.Meta(ge=1, le=2**22)]


class ForkRefused(_W, tag="fork_refused"):
    """A fork server's answer to `Fork` when it did not fork, and why (e.g. it is not single-threaded)."""

    reason: Annotated[str, msgspec.Meta(max_length=TEXT_LIMIT)]


WorkerMessage = (Hello | PhaseChanged | Heartbeat | Progress | Checkpointed | Result | Failure | Stacks | Forked
                 | ForkRefused)


# daemon -> worker


class Assign(_W, tag="assign"):
    """Which rank of which attempt this interpreter becomes."""

    job_id: str
    attempt: int
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    store_host: str
    store_port: int
    spec: JobSpec
    env: dict[str, str]
    heartbeat_interval: float
    join_timeout: float
    checkpoint_dir: str
    pgid: int = 0  # 0: already in the right group (cold spawn); else setpgid to it
    log_path: str = ""  # "": keep stdout/stderr (cold spawn); else append stdout to this file (warm pool)
    err_path: str = ""  # warm pool: append stderr to this file ("": to `log_path` too)
    unset: list[str] = msgspec.field(default_factory=list)  # warm pool: variables the job's environment lacks
    # the store's host (local rank 0 where the daemon bound the attempt's port): the listening socket
    # comes with this frame (SCM_RIGHTS); the rank serves the attempt's TCPStore on it before its work
    serve_store: bool = False
    # hot rank replacement (built-in tasks): the rank may wait for a Reform after a peer is lost; a
    # replacement (generation > 0) joins the group re-formed on the store prefix of its generation and
    # takes its state from the lowest rank instead of a checkpoint
    hot_replace: bool = False
    generation: Annotated[int, msgspec.Meta(ge=0, le=10**6)] = 0
    # a CPU job's rank under the daemon's default `cpu_rank_policy`: every thread to SCHED_BATCH
    sched_batch: bool = False


class Stop(_W, tag="stop"):
    """Stop at the next step boundary, checkpoint, exit 0. `signal` (a script's job, not 0): raise that
    signal in the rank where the script handles it (its own Python handler), as Slurm's --signal."""

    reason: str = ""
    signal: Annotated[int, msgspec.Meta(ge=0, le=64)] = 0


class DumpStacks(_W, tag="dump"):
    """A hang: write every thread's stack into the rank log (and NCCL's flight recorder beside it)."""


class AskStacks(_W, tag="ask_stacks"):
    """Answer with a Stacks frame carrying `request`; the rank keeps running."""

    request: RequestNumber


class Release(_W, tag="release"):
    """The store's host may leave: every other local rank has exited (until then it keeps serving
    the attempt's store after its own result, as torchrun's agent keeps its store)."""


class Reform(_W, tag="reform"):
    """A rank was lost and is being replaced: leave the broken group, join the group of `generation`
    (same world size, same ranks, the store prefix of that generation), take the lowest rank's model,
    optimizer and step, and train on; a step in flight is redone."""

    generation: Annotated[int, msgspec.Meta(ge=1, le=10**6)]


class Fork(_W, tag="fork"):
    """To a fork server: fork one pooled worker. The end of its channel comes with this frame
    (SCM_RIGHTS); the server answers `Forked` or `ForkRefused`, the new worker says Hello on its own
    channel and waits for its Assign there."""


DaemonMessage = Assign | Stop | DumpStacks | AskStacks | Release | Reform | Fork
