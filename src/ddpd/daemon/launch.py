"""Starting the ranks of an attempt: argv and environment built once, cold spawn or pool adoption.

Each rank's environment is built once (`rank_env`) on a base (`base_env`): the submitter's
exported environment with HOME, USER, LOGNAME and SHELL from the passwd entry (a job from a
client that sends `spec.environ`), else the warm pool's base (the daemon's environment less
systemd's variables). Then the job's ``spec.env``, then the daemon's reserved variables on top
(``protocol.worker.RESERVED_ENV``: rank layout, rendezvous, the attempt marker, devices), so a job
can neither move its rank nor hide from teardown nor see devices it was not given. A cold rank
runs ``spec.python`` (else the configured worker command or the daemon's interpreter) as the
submitter (`run_as`, through the gate) and inside the attempt's cgroup (`place`) where there is
one; its Assign carries no environment. A pooled rank (only for jobs with the daemon's own
interpreter, environment and user), started before the job existed, gets the difference to its
base in ``Assign.env``.

`Launcher.start` returns the same `RankHandle` either way.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

import msgspec

from ..protocol.channel import Assign
from ..protocol.worker import MARKER_ENV, is_reserved_env, worker_args
from . import procs
from .channel import WorkerChannel
from .clock import Clock
from .config import Config
from .identity import Identity, job_environment
from .nodes import NodeLayout
from .pool import COLD_ENV_PREFIXES, POOL_SAFE_ENV, WarmPool, pool_eligible, pool_env
from .ranks import RankHandle
from .records import Job, Rank
from .rendezvous import Rendezvous


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
    env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    env.update(defaults or {})
    env.update({k: v for k, v in spec.env.items() if not is_reserved_env(k)})
    if not job.gpus:
        devices = ""  # a CPU job never touches a GPU the scheduler gave another job
    elif spec.script is not None:
        # torchrun's layout: every rank sees the job's GPUs and `cuda:LOCAL_RANK` is its own
        # (rank r's are devices r*k .. r*k+k-1 with k = gpus_per_rank)
        devices = ",".join(str(g) for g in job.gpus)
    else:  # the built-in loop: each rank sees only its own GPUs, as cuda:0..
        per = spec.gpus_per_rank
        devices = ",".join(str(g) for g in job.gpus[rank * per : (rank + 1) * per])
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
    })
    return env


def base_env(job: Job, identity: Identity) -> dict[str, str]:
    """What a rank's environment starts from: the submitter's exported variables (reserved names
    dropped) and the passwd identity; the daemon's own (pool_env) for a client that sent none."""
    if job.spec.environ is None:
        return pool_env()
    exported = {k: v for k, v in job.spec.environ.items() if not is_reserved_env(k)}
    return job_environment(identity, exported, {}, {})


def same_interpreter(a: str, b: str) -> bool:
    """The same interpreter of the same environment: the same file name's directory (a venv's `bin`,
    resolved), and the same resolved file. Two venvs over one base interpreter are not the same."""
    return (os.path.realpath(os.path.dirname(a)) == os.path.realpath(os.path.dirname(b))
            and os.path.realpath(a) == os.path.realpath(b))


def pool_fits(python: str | None, environ: Mapping[str, str] | None, pool_base: Mapping[str, str],
              pool_python: str) -> bool:
    """Whether a pooled interpreter can become a rank of this job: the job runs the pool's interpreter,
    and every variable read at interpreter or torch start has the value the pool started with (the
    rest of the job's environment is applied on assignment)."""
    if python is not None and not same_interpreter(python, pool_python):
        return False
    if environ is None:
        return True
    keys = {k for k in (*environ, *pool_base)
            if k.startswith(COLD_ENV_PREFIXES) and k not in POOL_SAFE_ENV and k != "PYTHONUNBUFFERED"}
    return all(environ.get(k) == pool_base.get(k) for k in keys)


class Launcher:
    """Starts the ranks of one attempt (cold, or from the warm pool when the job may use it)."""

    def __init__(self, config: Config, job: Job, number: int, marker: str, rdzv: Rendezvous, attempt_dir: Path,
                 join_timeout: float, clock: Clock, pool: WarmPool | None,
                 defaults: Mapping[str, str] | None = None, *, identity: Identity, run_as: Identity | None = None,
                 place: Callable[[int], None] | None = None, job_dir: Path, checkpoint_dir: Path,
                 layout: NodeLayout | None = None) -> None:
        self.defaults = dict(defaults or {})
        self.layout = layout  # a multi-node attempt: this node's place in the world
        self.offset = 0 if layout is None else layout.offset
        self.config, self.job, self.number, self.rdzv, self.clock = config, job, number, rdzv, clock
        self.marker = marker
        self.join_timeout = join_timeout
        self.attempt_dir = attempt_dir
        self.run_as = run_as  # the submitter, when this (root) daemon starts ranks as another user
        self.place = place  # enters a rank into the attempt's cgroup, where there is one
        self.base = base_env(job, identity)
        self.pool_base = pool_env()  # what a pooled interpreter was started with
        fits = run_as is None and pool_fits(job.spec.python, job.spec.environ, self.pool_base, self._pool_python())
        self.pool = pool if pool is not None and fits and pool_eligible(job.spec) is None else None
        self.cwd = job.spec.workdir or str(job_dir)
        self.checkpoint_dir = checkpoint_dir
        self.envs: dict[int, dict[str, str]] = {}

    def env(self, rank: int) -> dict[str, str]:
        if rank not in self.envs:
            self.envs[rank] = rank_env(self.base, self.job, self.number, rank, self.rdzv, self.marker,
                                       self.attempt_dir / f"rank-{self.offset + rank}-error.json", self.defaults,
                                       self.layout)
        return self.envs[rank]

    def _pool_python(self) -> str:
        return (self.config.worker_command or (sys.executable,))[0]

    def argv_prefix(self) -> tuple[str, ...]:
        if self.job.spec.python is not None:
            return (self.job.spec.python, "-m", "ddpd.worker")
        return self.config.worker_command or (sys.executable, "-m", "ddpd.worker")

    def start(self, rank: int, log_path: Path, log_fd: int, pgid: int | None) -> RankHandle:
        """Local rank `rank`, from the pool (already CONNECTED: its Hello is in `handle.hello`) or cold.

        `log_fd` becomes a cold rank's stdout and stderr (the caller closes it); a pooled rank
        appends to `log_path` itself. `pgid` None: the rank leads the attempt's new process group.
        Raises OSError when a cold start (or the cgroup placement of a pooled one) fails.
        """
        taken = self.pool.take() if self.pool is not None else None
        if taken is not None:
            proc, channel, hello = taken
            handle = self._handle(rank, proc, channel, log_path, pgid or proc.pid, pooled=True)
            handle.hello = hello
            if self.place is not None:  # still the daemon's own code: no race with job code
                try:
                    self.place(proc.pid)
                except OSError:
                    channel.close()
                    proc.kill()
                    proc.wait()
                    raise
            return handle
        parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        argv = [*self.argv_prefix(), *worker_args(child_end.fileno(), os.getpid())]
        try:
            proc = procs.spawn(argv, env=self.env(rank), cwd=self.cwd, log_fd=log_fd,
                               pass_fds=[child_end.fileno()], process_group=pgid or 0,
                               identity=self.run_as, place=self.place)
        except OSError:
            parent_end.close()
            raise
        finally:
            child_end.close()
        return self._handle(rank, proc, WorkerChannel(parent_end), log_path, pgid or proc.pid, pooled=False)

    def _handle(self, r: int, proc: subprocess.Popen[bytes], channel: WorkerChannel, log_path: Path, pgid: int,
                pooled: bool) -> RankHandle:
        rank = Rank(rank=self.offset + r, attempt=self.number, pid=proc.pid, pgid=pgid, log=str(log_path),
                    spawned_at=self.clock.monotonic())
        return RankHandle(rank=rank, proc=proc, channel=channel, pooled=pooled)

    def assignment(self, h: RankHandle, pgid: int) -> Assign:
        rank = h.rank
        local = rank.rank - self.offset
        world = self.job.spec.nproc if self.layout is None else self.layout.world_size
        spec = self.job.spec
        if spec.environ is not None:  # the rank runs in it already: no need to carry it again
            spec = msgspec.structs.replace(spec, environ=None)
        env: dict[str, str] = {}
        unset: list[str] = []
        if h.pooled:  # started before the job: it gets what its environment lacks, and the job's directory
            env = {k: v for k, v in self.env(local).items() if self.pool_base.get(k) != v}
            unset = sorted(k for k in self.pool_base if k not in self.env(local))
            if not spec.workdir:
                spec = msgspec.structs.replace(spec, workdir=self.cwd)
        return Assign(
            job_id=self.job.id, attempt=self.number, rank=rank.rank, world_size=world,
            local_rank=local, local_world_size=spec.nproc, store_host=self.rdzv.host,
            store_port=self.rdzv.port, spec=spec, env=env, heartbeat_interval=self.config.heartbeat_interval,
            join_timeout=self.join_timeout,
            checkpoint_dir=str(self.checkpoint_dir),
            pgid=pgid if h.pooled else 0, log_path=(rank.log or "") if h.pooled else "", unset=unset,
        )
