"""What the daemon answers with on the control socket: jobs, ranks, events, log chunks, and each
request's result (`protocol.control` holds the requests and the reply envelopes, and re-exports
these). Replies are built by the daemon and kept under the frame limit by it (clipped texts)."""

from __future__ import annotations

from typing import Any

import msgspec

from .limits import clip_text
from .nodes import NodeView
from .spec import JobSpec


class RootCause(msgspec.Struct, omit_defaults=True):
    reason: str
    rank: int | None = None
    attempt: int | None = None
    exit_code: int | None = None
    signal: str | None = None
    phase: str | None = None
    error: str | None = None
    message: str | None = None
    traceback: str | None = None
    ranks: list[int] | None = None
    detail: str | None = None

    def clipped(self) -> RootCause:
        """This cause with its texts clipped, head and tail kept (`reason` to 200 characters, the others
        to TEXT_LIMIT): what is stored and shown in every reply; the whole text stays in the rank log."""
        return msgspec.structs.replace(self, reason=clip_text(self.reason, 200), **{
            k: clip_text(v) for k in ("phase", "error", "message", "traceback", "detail", "signal")
            if isinstance(v := getattr(self, k), str)})


class RankGpu(msgspec.Struct, omit_defaults=True):
    """A GPU a rank was given, and the memory the rank's own process holds on it (bytes; None where
    NVML cannot tell: no NVML, the process not on the GPU yet, or the driver hides it)."""

    index: int  # NVML's (the parent GPU's for a MIG device), as every view names GPUs
    memory_used: int | None = None
    uuid: str = ""  # GPU-... or MIG-...; "" where the daemon knows its GPUs by count only
    mig: int | None = None  # the MIG device's index within GPU `index`
    share: float | None = None  # the fraction of the GPU the rank holds (gpus_per_rank < 1); None: whole
    utilization: list[int] = msgspec.field(default_factory=list)  # the GPU's % over the last minutes, oldest first


class GpuView(msgspec.Struct, omit_defaults=True):
    """One GPU as `ddpctl daemon` shows it: NVML's memory (bytes) and utilisation (percent, None where
    unknown), and the jobs holding it (given it by the scheduler, or with a rank's process on it)."""

    index: int  # NVML's (the parent GPU's for a MIG device)
    name: str
    memory_total: int | None  # None where NVML could not say
    memory_used: int | None
    utilization: int | None = None
    jobs: list[str] = msgspec.field(default_factory=list)
    other_processes: int = 0  # processes on it that are no rank of a running job
    uuid: str = ""  # GPU-... or MIG-...; "" where the daemon knows its GPUs by count only
    mig: int | None = None  # the MIG device's index within GPU `index`
    held: float = 0.0  # the fraction of it running jobs hold (fractional gpus_per_rank pack onto one GPU)
    draining: list[str] = msgspec.field(default_factory=list)  # ended jobs whose ranks may still hold it
    quarantined: str | None = None  # why no job is placed on it ("Xid 79, fell off the bus") until released


class RankView(msgspec.Struct, omit_defaults=False):
    rank: int
    attempt: int
    state: str
    pid: int | None = None
    pgid: int | None = None
    step: int = 0
    loss: float | None = None
    heartbeat_age: float | None = None
    exit_code: int | None = None
    signal: str | None = None
    checksum: float | None = None
    log: str | None = None
    stack_dump: bool = False
    gpus: list[RankGpu] = msgspec.field(default_factory=list)
    replacements: int = 0  # times the rank was replaced in place (hot replacement) in this attempt


class JobView(msgspec.Struct, omit_defaults=False):
    id: str
    name: str
    state: str
    owner_uid: int
    submitted_at: float
    spec: JobSpec
    attempt: int = 0
    started_at: float | None = None
    finished_at: float | None = None
    reason: str | None = None
    root_cause: RootCause | None = None
    ranks: list[RankView] = msgspec.field(default_factory=list)
    store_port: int | None = None
    nodes: list[NodeView] = msgspec.field(default_factory=list)  # a multi-node job's nodes (protocol.nodes)
    waiting_on: list[str] | None = None  # a queued job's dependencies (--after) that have not yet succeeded
    # why a queued job has not started: "resources: ...", "priority: behind ...", "dependency: ...",
    # "limit: ...", "user limit: ..." (None: not queued, or not yet looked at)
    pending: str | None = None
    queue_position: int | None = None  # while QUEUED: 1 is the next to start, in the scheduler's order


class EventView(msgspec.Struct, omit_defaults=True):
    seq: int
    ts: float
    kind: str
    job_id: str | None = None
    attempt: int | None = None
    rank: int | None = None
    data: dict[str, Any] = msgspec.field(default_factory=dict)


class LogChunk(msgspec.Struct, omit_defaults=True):
    """Text of a rank's log; `error` (text empty) says why that rank's log cannot be read, and the
    stream carries on without it."""

    rank: int
    attempt: int
    text: str
    error: str | None = None
    stream: str | None = None  # "stdout" or "stderr" (None: from a daemon that kept them together)
    time: float | None = None  # when the daemon received these lines (seconds since the epoch)


class SubmitResult(msgspec.Struct):
    job_id: str
    existing: bool = False  # True: the idempotency key matched a job submitted before
    of: str | None = None  # a resubmit: the full id of the job whose spec was submitted again
    # what the submitter should know, one sentence each (its history at its bounds: its oldest ended
    # jobs are retired as new ones end); the job was accepted either way
    notices: list[str] = []


class RemoveResult(msgspec.Struct):
    """What `rm` removed: the full id of the job the request named (perhaps by a prefix)."""

    job_id: str


class JobPage(msgspec.Struct):
    """A page of `list`: `next` is the `before` of the following page, None on the last."""

    jobs: list[JobView]
    next: int | None = None


class CancelResult(msgspec.Struct):
    """What a cancel did: `action` is "cancelled" (a queued job, now CANCELLED), "stopping" (ranks asked
    to stop at a step boundary, then torn down), "killing" (force: SIGKILL now), or
    "already_stopping" (a cancel without force of a job already being stopped)."""

    action: str
    job: JobView


class PoolServerView(msgspec.Struct, omit_defaults=False):
    """One fork server of the warm pool (``pool_fork_server``) as `ddpctl daemon` shows it. Its key (the
    user's interpreter and a digest of the start-up environment the pool keys it by) and its pid are
    for its user, root and the admin group; to anyone else they are None, and only the counts show.
    `pss`: bytes of proportional set size of the server and its ready spares (/proc/PID/smaps_rollup;
    None: unknown, the read did not finish in time); `idle`: seconds since a job of its key last
    started (None: its key is being forgotten)."""

    uid: int
    state: str  # "starting" (importing torch) or "ready" (forking)
    user: str | None = None  # the uid's name in passwd
    pid: int | None = None
    python: str | None = None  # the interpreter its key was learned from
    env: str | None = None  # digest of the key's start-up environment (12 hex digits)
    pss: int | None = None
    forks: int = 0  # workers it forked (spares included)
    spares: int = 0  # workers it forked ahead, ready for the next job's ranks
    idle: float | None = None


class DaemonInfo(msgspec.Struct):
    version: str
    protocol: int
    pid: int
    uptime: float
    socket: str
    state_dir: str
    running: int
    queued: int
    cpu_slots: int
    gpus: int
    free_cpu_slots: int | None = None
    free_gpus: int | None = None
    pool_ready: int | None = None
    pool_state: str | None = None  # the warm pool in words: "warm (2 ready)", "cold (busy)", "off"
    gpu_devices: list[GpuView] = msgspec.field(default_factory=list)
    gpu_note: str | None = None  # why gpu_devices is empty on a daemon with GPUs (NVML unavailable...)
    # the fork servers (a daemon without them, or older than them: empty)
    pool_servers: list[PoolServerView] = msgspec.field(default_factory=list)


class GpuReleaseResult(msgspec.Struct):
    """What `gpu release` lifted: the GPU ("GPU 3 (GPU-...)") and why it had been quarantined."""

    gpu: str
    reason: str
    since: float


class ShareView(msgspec.Struct):
    """One user's share of the box: usage decayed to now (GPU-seconds, CPU-slot-seconds), its part of all
    users' usage (0 to 1), the fair-share factor that orders jobs of equal priority (1: has used nothing
    lately; lower: has used more than an equal share), and its jobs running and queued."""

    uid: int
    gpu_seconds: float
    cpu_seconds: float
    usage: float
    factor: float
    running: int = 0
    queued: int = 0
    name: str | None = None


class ShareResult(msgspec.Struct):
    """`share`: every user with usage or unended jobs, the one with the highest factor first."""

    users: list[ShareView]
    half_life: float  # seconds for usage to halve (0: no decay)


class WhoAmI(msgspec.Struct):
    """The caller as the daemon sees it: the uid from the socket, the name and groups from the passwd
    and group databases (`name` None: no passwd entry, `groups` empty then); `detail_of_all`: may see
    every job's detail (root, the admin group, the user of a per-user daemon); `may_reload`: may reload
    the daemon; `submit_refusal`: why the daemon takes no jobs from it (None: it takes them)."""

    uid: int
    name: str | None = None
    groups: list[str] = msgspec.field(default_factory=list)
    admin_group: str | None = None
    detail_of_all: bool = False
    may_reload: bool = False
    submit_refusal: str | None = None


class CurvePoint(msgspec.Struct, array_like=True):
    """One point of a curve: the wall time and step of its last sample, the mean loss of the samples it
    merged (None: no finite loss among them) and the steps per second over the time it covers."""

    time: float
    step: int
    loss: float | None = None
    steps_per_second: float | None = None


class CurveResult(msgspec.Struct, omit_defaults=True):
    """A job's curve, oldest point first. `steps`: the job's target step count (task mode; None for a
    script); `stride`: samples merged per point; `backwards`: samples kept out because their step went
    back; `nonfinite`: NaN or infinite losses kept out."""

    job_id: str
    state: str
    points: list[CurvePoint]
    steps: int | None = None
    stride: int = 1
    backwards: int = 0
    nonfinite: int = 0


class StackGroup(msgspec.Struct, omit_defaults=True):
    """One stack (traceback text, innermost frame last) and the ranks whose thread `thread` has it."""

    thread: str
    ranks: list[int]
    stack: str
    main: bool = False


class RankStacks(msgspec.Struct, omit_defaults=True):
    """How one rank answered `stacks`: `answered` (its threads are in the groups), else `note` says why
    not; `native` is py-spy's dump of it (asked for with `native`, or the fallback of a silent rank)."""

    rank: int
    state: str
    answered: bool = False
    pid: int | None = None
    threads: int = 0
    omitted: int = 0  # threads the rank left out of its answer
    note: str | None = None
    native: str | None = None


class StacksResult(msgspec.Struct, omit_defaults=True):
    """The stacks of a running attempt's ranks, identical stacks grouped (main threads first)."""

    job_id: str
    attempt: int
    groups: list[StackGroup]
    ranks: list[RankStacks]
    note: str | None = None
