"""The contract between the daemon and a worker process, besides the channel's frames.

- The command line: ``<worker> --fd N --parent PID [--pool [--fork-server] | --agent]`` (`worker_args`
  writes it, `parse_worker_args` reads it): N is the inherited socketpair end, PID the daemon's pid
  (a worker whose parent is not PID exits at once with EXIT_ORPHANED), ``--pool`` a warm-pool
  interpreter, ``--fork-server`` one that forks pooled workers on request (``channel.Fork``) and
  never becomes a rank itself, ``--agent`` a multi-node job's rendezvous agent (``protocol.agent``).
- Exit codes a worker uses for itself: EXIT_ORPHANED (started by a parent that is already gone) and
  EXIT_DAEMON_GONE (its channel closed: it killed its process group and left).
- The attempt marker: every rank of an attempt, and every process it starts, carries
  ``DDPD_ATTEMPT=<job id>:<attempt>:<token>`` in its environment (`attempt_marker`), so teardown and
  recovery find escaped descendants in /proc.
- Reserved environment: the variables the daemon sets for each rank (rank layout, rendezvous, marker,
  devices). A job's ``spec.env`` cannot set them: names in RESERVED_ENV, or starting with one of
  RESERVED_ENV_PREFIXES (`is_reserved_env`).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

MARKER_ENV = "DDPD_ATTEMPT"
EXIT_ORPHANED = 70
EXIT_DAEMON_GONE = 71

RESERVED_ENV = frozenset({
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
    "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE",
    "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "TORCHELASTIC_USE_AGENT_STORE",
})
RESERVED_ENV_PREFIXES = ("DDPD_", "TORCHELASTIC_")


def is_reserved_env(name: str) -> bool:
    """True for a variable the daemon sets for every rank (a job may not set it)."""
    return name in RESERVED_ENV or name.startswith(RESERVED_ENV_PREFIXES)


def attempt_marker(job_id: str, attempt: int, token: str) -> str:
    """The marker's value: ``<job id>:<attempt>:<token>``."""
    return f"{job_id}:{attempt}:{token}"


def marker_entry(job_id: str, attempt: int, token: str) -> bytes:
    """The marker as it appears in /proc/PID/environ: ``DDPD_ATTEMPT=<value>``."""
    return f"{MARKER_ENV}={attempt_marker(job_id, attempt, token)}".encode()


@dataclass(frozen=True)
class WorkerArgs:
    fd: int
    parent: int
    pool: bool = False
    agent: bool = False
    fork_server: bool = False


def worker_args(fd: int, parent: int, pool: bool = False, agent: bool = False,
                fork_server: bool = False) -> list[str]:
    """The arguments after the worker's interpreter and module (see the module docstring)."""
    return ["--fd", str(fd), "--parent", str(parent), *(["--pool"] if pool or fork_server else []),
            *(["--fork-server"] if fork_server else []), *(["--agent"] if agent else [])]


def parse_worker_args(argv: Sequence[str] | None) -> WorkerArgs:
    parser = argparse.ArgumentParser(prog="python -m ddpd.worker")
    parser.add_argument("--fd", type=int, required=True, help="inherited AF_UNIX socket to the daemon")
    parser.add_argument("--parent", type=int, required=True, help="the daemon's pid")
    parser.add_argument("--pool", action="store_true", help="warm-pool interpreter: pre-import DDP")
    parser.add_argument("--fork-server", action="store_true", help="fork pooled workers on the daemon's request")
    parser.add_argument("--agent", action="store_true", help="a multi-node job's rendezvous agent")
    ns = parser.parse_args(argv)
    return WorkerArgs(fd=ns.fd, parent=ns.parent, pool=ns.pool or ns.fork_server, agent=ns.agent,
                      fork_server=ns.fork_server)
