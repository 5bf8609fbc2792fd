"""Starting the ranks of an attempt: argv and environment built once, cold spawn or pool adoption.

Each rank's environment is built once (`rank_env`), on the warm pool's base (the daemon's
environment less systemd's variables): the job's ``spec.env`` first, then the daemon's reserved
variables on top (``protocol.worker.RESERVED_ENV``: rank layout, rendezvous, the attempt marker,
devices), so a job can neither move its rank nor hide from teardown nor see devices it was not
given. A cold rank is started with that environment and its Assign carries none; a pooled rank,
started before the job existed, gets the difference to its base in ``Assign.env``.

`Launcher.start` returns the same `RankHandle` either way.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import msgspec

from ..protocol.channel import Assign
from ..protocol.worker import MARKER_ENV, is_reserved_env, worker_args
from . import procs
from .channel import WorkerChannel
from .clock import Clock
from .config import Config
from .pool import WarmPool, pool_eligible, pool_env
from .ranks import RankHandle
from .records import Job, Rank, job_dir
from .rendezvous import Rendezvous


def rank_env(base: dict[str, str], job: Job, number: int, rank: int, rdzv: Rendezvous, marker: str,
             error_file: Path, defaults: Mapping[str, str] | None = None) -> dict[str, str]:
    """The whole environment of one rank: `base`, defaults (the job's NCCL settings on GPUs),
    ``spec.env``, then the reserved variables."""
    spec = job.spec
    n = spec.nproc
    env = dict(base)
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
    env.update({
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(n),
        "LOCAL_WORLD_SIZE": str(n),
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1",
        "ROLE_RANK": str(rank),
        "ROLE_NAME": "default",
        "ROLE_WORLD_SIZE": str(n),
        "MASTER_ADDR": rdzv.host,
        "MASTER_PORT": str(rdzv.port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": str(number - 1),
        "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
        "TORCHELASTIC_RUN_ID": job.id,
        "TORCHELASTIC_ERROR_FILE": str(error_file),
        "DDPD_JOB_ID": job.id,
        MARKER_ENV: marker,
        "CUDA_VISIBLE_DEVICES": devices,
    })
    return env


def make_dirs(*paths: Path) -> None:
    """Create the attempt's directories (blocking: call it from a thread). The job can write its job
    directory: one of them already there as a symlink (or anything but a directory) is refused."""
    for path in paths:
        path.mkdir(parents=True, exist_ok=True)
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            raise OSError(errno.ENOTDIR, f"{path} is not a directory (a symlink is not followed)")


class Launcher:
    """Starts the ranks of one attempt (cold, or from the warm pool when the job may use it)."""

    def __init__(self, config: Config, job: Job, number: int, marker: str, rdzv: Rendezvous, attempt_dir: Path,
                 join_timeout: float, clock: Clock, pool: WarmPool | None,
                 defaults: Mapping[str, str] | None = None) -> None:
        self.defaults = dict(defaults or {})
        self.config, self.job, self.number, self.rdzv, self.clock = config, job, number, rdzv, clock
        self.marker = marker
        self.join_timeout = join_timeout
        self.attempt_dir = attempt_dir
        self.pool = pool if pool is not None and pool_eligible(job.spec) is None else None
        self.base = pool_env()
        self.cwd = job.spec.workdir or str(job_dir(config.state_dir, job.id))
        self.envs: dict[int, dict[str, str]] = {}

    def env(self, rank: int) -> dict[str, str]:
        if rank not in self.envs:
            self.envs[rank] = rank_env(self.base, self.job, self.number, rank, self.rdzv, self.marker,
                                       self.attempt_dir / f"rank-{rank}-error.json", self.defaults)
        return self.envs[rank]

    def start(self, rank: int, log_path: Path, pgid: int | None) -> RankHandle:
        """Rank `rank`, from the pool (already CONNECTED: its Hello is in `handle.hello`) or cold.

        `pgid` None: the rank leads the attempt's new process group. Raises OSError when a cold
        start fails.
        """
        taken = self.pool.take() if self.pool is not None else None
        if taken is not None:
            proc, channel, hello = taken
            handle = self._handle(rank, proc, channel, log_path, pgid or proc.pid, pooled=True)
            handle.hello = hello
            return handle
        parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        argv = [*(self.config.worker_command or (sys.executable, "-m", "ddpd.worker")),
                *worker_args(child_end.fileno(), os.getpid())]
        try:
            proc = procs.spawn(argv, env=self.env(rank), cwd=self.cwd, log_path=log_path,
                               pass_fds=[child_end.fileno()], process_group=pgid or 0)
        except OSError:
            parent_end.close()
            raise
        finally:
            child_end.close()
        return self._handle(rank, proc, WorkerChannel(parent_end), log_path, pgid or proc.pid, pooled=False)

    def _handle(self, r: int, proc: subprocess.Popen[bytes], channel: WorkerChannel, log_path: Path, pgid: int,
                pooled: bool) -> RankHandle:
        rank = Rank(rank=r, attempt=self.number, pid=proc.pid, pgid=pgid, log=str(log_path),
                    spawned_at=self.clock.monotonic())
        return RankHandle(rank=rank, proc=proc, channel=channel, pooled=pooled)

    def assignment(self, h: RankHandle, pgid: int) -> Assign:
        rank = h.rank
        spec = self.job.spec
        env: dict[str, str] = {}
        if h.pooled:  # started before the job: it gets what its environment lacks, and the job's directory
            env = {k: v for k, v in self.env(rank.rank).items() if self.base.get(k) != v}
            if not spec.workdir:
                spec = msgspec.structs.replace(spec, workdir=self.cwd)
        return Assign(
            job_id=self.job.id, attempt=self.number, rank=rank.rank, world_size=spec.nproc,
            local_rank=rank.rank, local_world_size=spec.nproc, store_host=self.rdzv.host,
            store_port=self.rdzv.port, spec=spec, env=env, heartbeat_interval=self.config.heartbeat_interval,
            join_timeout=self.join_timeout,
            checkpoint_dir=str(job_dir(self.config.state_dir, self.job.id) / "checkpoints"),
            pgid=pgid if h.pooled else 0, log_path=(rank.log or "") if h.pooled else "",
        )
