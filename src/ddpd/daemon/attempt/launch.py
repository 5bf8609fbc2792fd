"""Starting the ranks of an attempt: argv and environment built once, cold spawn or pool adoption.

Each rank's environment is built once (`rank_env`) on a base (`poolkeys.base_env`): the submitter's
exported environment with HOME, USER, LOGNAME and SHELL from the passwd entry (a job from a
client that sends `spec.environ`), else the passwd entry's variables and a sane PATH, or for the
daemon's own user the warm pool's base (the daemon's environment less systemd's variables).
Then the job's ``spec.env``, then the daemon's reserved variables on top
(``protocol.worker.RESERVED_ENV``: rank layout, rendezvous, the attempt marker, devices), so a job
can neither move its rank nor hide from teardown nor see devices it was not given. A cold rank
runs ``spec.python`` (else the configured worker command or the daemon's interpreter) as the
submitter (`run_as`, through the gate) and inside the attempt's cgroup (`place`) where there is
one; its Assign carries no environment. A pooled rank (a worker of the job's `PoolKey`: the
same user, interpreter and start-up environment), started before the job existed, gets the
difference to the environment it started with in ``Assign.env`` (and the names to unset), the
job's working directory, and its cgroup moved into the attempt's (`Cgroup.take_over`):
from then on it is the cold start it stands in for.

`Launcher.start` returns the same `RankHandle` either way.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import anyio.to_thread
import msgspec

from ...protocol.channel import Assign
from ...protocol.spec import DEFAULT_UMASK, JobSpec, hot_replacements
from ...protocol.worker import MARKER_ENV, is_reserved_env, worker_args
from ..config import Config
from ..contain import procs
from ..contain.cgroups import Cgroup
from ..contain.identity import Identity
from ..gpu.layout import OWN_DEVICES_ENV, rank_visible
from ..layout import rank_error_file_name, stderr_log
from ..multinode.nodes import NodeLayout
from ..pool.channel import WorkerChannel
from ..pool.members import POOL
from ..pool.pool import PoolWorker, WarmPool
from ..pool.poolkeys import PoolKey, Shape, base_env, pool_eligible, start_env
from ..run.clock import Clock
from ..run.rendezvous import Rendezvous
from ..store.records import Job, Rank
from .ranks import RankHandle

TAKE_OVER_WAIT = 5.0  # seconds for a pooled worker's own cgroup to empty once its processes moved



def rank_umask(spec: JobSpec) -> int:
    """The umask a job's ranks run with: the submitter's, as sent (DEFAULT_UMASK where not)."""
    return DEFAULT_UMASK if spec.umask is None else spec.umask

def rank_env(base: dict[str, str], job: Job, number: int, rank: int, rdzv: Rendezvous, marker: str,
             error_file: Path, defaults: Mapping[str, str] | None = None,
             layout: NodeLayout | None = None) -> dict[str, str]:
    """The whole environment of local rank `rank`: `base`, defaults (the job's NCCL settings on GPUs),
    ``spec.env``, then the reserved variables (across nodes as torchrun sets them, with `layout`)."""
    spec = job.spec
    n = spec.nproc
    env = dict(base)
    if spec.environ is None or "OMP_NUM_THREADS" not in spec.environ:  # the submitter's own choice stays
        env["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // n))
    env.update(defaults or {})
    env.update({k: v for k, v in spec.env.items() if not is_reserved_env(k)})
    # by UUID; a CPU job sees none (never a GPU the scheduler gave another job); a script sees the
    # job's GPUs (torchrun's layout) and its own in DDPD_CUDA_DEVICES (see gpu.layout)
    devices, own = rank_visible(job.gpus, spec, rank)
    lay = layout or NodeLayout(node_rank=0, nnodes=1, offset=0, world_size=n, run_id=job.id,
                               restart_count=number - 1)
    env.update({
        "RANK": str(lay.offset + rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(lay.world_size),
        "LOCAL_WORLD_SIZE": str(n),
        "GROUP_RANK": str(lay.node_rank),
        "GROUP_WORLD_SIZE": str(lay.nnodes),
        "ROLE_RANK": str(lay.offset + rank),
        "ROLE_NAME": "default",
        "ROLE_WORLD_SIZE": str(lay.world_size),
        "MASTER_ADDR": rdzv.host,
        "MASTER_PORT": str(rdzv.port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": str(lay.restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
        "TORCHELASTIC_RUN_ID": lay.run_id,
        "TORCHELASTIC_ERROR_FILE": str(error_file),
        "DDPD_JOB_ID": job.id,
        MARKER_ENV: marker,
        "CUDA_VISIBLE_DEVICES": devices,
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",  # indices as NVML counts (UUIDs need no order)
        OWN_DEVICES_ENV: own,
    })
    return env


@dataclass(frozen=True)
class LaunchContext:
    """What one attempt's ranks start from, all known before the first of them starts."""

    config: Config
    job: Job
    number: int
    marker: str
    rdzv: Rendezvous
    identity: Identity  # the submitter
    run_as: Identity | None  # the submitter, when this (root) daemon starts ranks as another user
    attempt_dir: Path
    job_dir: Path
    checkpoint_dir: Path
    join_timeout: float
    clock: Clock
    cgroup: Cgroup | None = None  # the attempt's: cold ranks start in it, pooled ranks' cgroups move in
    layout: NodeLayout | None = None  # a multi-node attempt: this node's place in the world
    defaults: Mapping[str, str] = field(default_factory=dict)  # every rank's, below the job's own env


class Launcher:
    """Starts the ranks of one attempt (cold, or from the warm pool when the job may use it)."""

    def __init__(self, ctx: LaunchContext, pool: WarmPool | None) -> None:
        job = ctx.job
        self.defaults = dict(ctx.defaults)
        self.layout = ctx.layout
        self.offset = 0 if ctx.layout is None else ctx.layout.offset
        self.config, self.job, self.number, self.rdzv, self.clock = ctx.config, job, ctx.number, ctx.rdzv, ctx.clock
        self.marker = ctx.marker
        self.join_timeout = ctx.join_timeout
        self.attempt_dir = ctx.attempt_dir
        self.run_as = ctx.run_as
        self.cgroup = ctx.cgroup
        self.place = None if ctx.cgroup is None else ctx.cgroup.add  # enters a cold rank into the cgroup
        self.base = base_env(job.spec.environ, ctx.identity)
        self.pool = pool if pool is not None and pool_eligible(job.spec) is None else None
        self.cwd = job.spec.workdir or str(ctx.job_dir)
        self.checkpoint_dir = ctx.checkpoint_dir
        self.envs: dict[int, dict[str, str]] = {}
        self.pool_envs: dict[int, dict[str, str]] = {}  # what each pooled rank was started with
        self.shape = self._shape(ctx.identity)
        self.hot_replace = hot_replacements(job.spec) > 0  # every rank may wait for a Reform
        self.generations: dict[int, int] = {}  # local rank -> the generation its replacement joins

    def _shape(self, identity: Identity) -> Shape:
        """This job's pool key and how a pooled interpreter of it is started (as a cold rank would be)."""
        argv = self.argv_prefix()
        env = start_env(self.base)
        uid = self.run_as.uid if self.run_as is not None else os.geteuid()
        cwd = str(self.config.state_dir) if self.run_as is None else "/"
        return Shape(key=PoolKey.of(uid, argv[0], env), argv=argv, env=env, identity=self.run_as, cwd=cwd)

    def use_pool(self) -> None:
        """Tell the pool this job's shape is in use (it keeps interpreters of it warm from now on)."""
        if self.pool is not None:
            self.pool.use(self.shape, self.job.spec.nproc)

    def env(self, rank: int) -> dict[str, str]:
        if rank not in self.envs:
            self.envs[rank] = rank_env(self.base, self.job, self.number, rank, self.rdzv, self.marker,
                                       self.attempt_dir / rank_error_file_name(self.offset + rank), self.defaults,
                                       self.layout)
        return self.envs[rank]

    def argv_prefix(self) -> tuple[str, ...]:
        if self.job.spec.python is not None:
            return (self.job.spec.python, "-m", "ddpd.worker")
        return self.config.worker_command or (sys.executable, "-m", "ddpd.worker")

    async def start(self, rank: int, log_path: Path, log_fds: tuple[int, int]) -> RankHandle:
        """Local rank `rank`, from the pool (already CONNECTED: its Hello is in `handle.hello`) or cold.

        `log_fds` become a cold rank's stdout and stderr (the caller closes them); a pooled rank
        appends to `log_path` and the stderr file beside it itself. Each rank leads a session and a
        process group of its own (a pooled one since the pool started it). A pooled rank's cgroup
        moves in off the event loop (it may wait up to TAKE_OVER_WAIT for the worker's cgroup to
        empty).
        Raises OSError when a cold start (or the cgroup placement of a pooled one) fails.
        """
        taken = None
        if self.pool is not None and self.pool.serves(self.shape) and (self.cgroup is not None
                                                                         or not self.pool.contained):
            taken = await self.pool.take(self.shape.key, wait=self.join_timeout / 4)  # (a starting server)
        if taken is None:
            return self._spawn(rank, log_path, log_fds)
        handle = self._handle(rank, taken.proc, taken.channel, log_path, pooled=True)
        handle.hello = taken.hello
        self.pool_envs[rank] = taken.env
        with anyio.CancelScope(shield=True):  # bounded; the worker is ours now: never dropped half-adopted
            await anyio.to_thread.run_sync(self._adopt, taken)
        return handle

    def _adopt(self, taken: PoolWorker) -> None:
        """Move a pooled worker into the attempt's cgroup (blocking); OSError, the worker gone, if it cannot."""
        try:
            if taken.cgroup is not None and self.cgroup is not None:
                # everything of the worker's cgroup (anything its interpreter's start forked too) moves in
                if not self.cgroup.take_over(taken.cgroup, TAKE_OVER_WAIT):
                    raise OSError(f"the pooled worker's cgroup {taken.cgroup.path} did not empty")
            elif self.place is not None:
                self.place(taken.proc.pid)
        except OSError:
            taken.channel.close()
            taken.proc.kill()
            taken.proc.wait()
            if taken.cgroup is not None:
                POOL.end(taken.cgroup)  # whatever stayed behind in it
            raise

    def _spawn(self, rank: int, log_path: Path, log_fds: tuple[int, int]) -> RankHandle:
        parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        argv = [*self.argv_prefix(), *worker_args(child_end.fileno(), os.getpid())]
        try:
            proc = procs.spawn(argv, env=self.env(rank), cwd=self.cwd, log_fd=log_fds[0],
                               err_fd=log_fds[1], pass_fds=[child_end.fileno()], process_group=None,
                               identity=self.run_as, place=self.place, umask=rank_umask(self.job.spec),
                               what=f"rank {self.offset + rank}'s start")
        except OSError:
            parent_end.close()
            raise
        finally:
            child_end.close()
        return self._handle(rank, proc, WorkerChannel(parent_end), log_path, pooled=False)

    def _handle(self, r: int, proc: subprocess.Popen[bytes], channel: WorkerChannel, log_path: Path,
                pooled: bool) -> RankHandle:
        rank = Rank(rank=self.offset + r, attempt=self.number, pid=proc.pid, pgid=proc.pid, log=str(log_path),
                    spawned_at=self.clock.monotonic())
        return RankHandle(rank=rank, proc=proc, channel=channel, pooled=pooled)

    def assignment(self, h: RankHandle) -> Assign:
        rank = h.rank
        local = rank.rank - self.offset
        world = self.job.spec.nproc if self.layout is None else self.layout.world_size
        spec = self.job.spec
        if spec.environ is not None:  # the rank runs in it already: no need to carry it again
            spec = msgspec.structs.replace(spec, environ=None)
        env: dict[str, str] = {}
        unset: list[str] = []
        if h.pooled:  # started before the job: it gets what its environment lacks, and the job's directory
            started = self.pool_envs.get(local, {})
            env = {k: v for k, v in self.env(local).items() if started.get(k) != v}
            unset = sorted(k for k in started if k not in self.env(local))
            if not spec.workdir:
                spec = msgspec.structs.replace(spec, workdir=self.cwd)
        return Assign(
            job_id=self.job.id, attempt=self.number, rank=rank.rank, world_size=world,
            local_rank=local, local_world_size=spec.nproc, store_host=self.rdzv.host,
            store_port=self.rdzv.port, spec=spec, env=env, heartbeat_interval=self.config.heartbeat_interval,
            join_timeout=self.join_timeout,
            checkpoint_dir=str(self.checkpoint_dir),
            pgid=0, log_path=(rank.log or "") if h.pooled else "", unset=unset,  # (pgid 0: it keeps its own group)
            err_path=stderr_log(rank.log or "") if h.pooled and rank.log else "",
            serve_store=self.rdzv.hosted and local == 0,
            hot_replace=self.hot_replace, generation=self.generations.get(local, 0),
            sched_batch=self.config.cpu_rank_policy == "batch" and not self.job.gpus,
        )
