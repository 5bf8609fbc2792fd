"""The daemon's side of a multi-node job's rendezvous agent: start it, ask it, end it.

The agent (``ddpd.worker --agent``, see ``ddpd.worker.agent``) runs torch's elastic rendezvous as
the job's user; the root daemon never does. It is started cold like a rank of the job (the job's
interpreter and environment, as its user, through the gate), in a process group of its own and,
where the daemon has a cgroup subtree, in a cgroup of its own (``<job>-rdzv``), for the job's life
on this node; `close` kills its group and cgroup and reaps it. Requests go out one at a time
(`call`), each bounded by a deadline; a reply is a typed, bounded `AgentReply` decoded here (a bad
frame, an exit or a silence is a NodeError naming the agent), so nothing the store holds reaches
the daemon but validated plain data.
"""

from __future__ import annotations

import array
import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import anyio
import anyio.lowlevel
import anyio.to_thread
import structlog

from ...protocol.agent import AgentError, AgentReply, AgentRequest
from ...protocol.framing import Decoder, FrameError, LineSplitter, encode
from ...protocol.worker import worker_args
from ..config import Config
from ..contain import helpers, procs
from ..contain.cgroups import Cgroup, Subtree
from ..contain.helpers import HelperKind
from ..contain.identity import Identity
from ..contain.usertree import create_user_file
from ..pool.poolkeys import base_env
from ..store.records import Job
from .elastic import NodeError

log = structlog.get_logger("ddpd")

AGENT_LOG = "rendezvous.log"
RDZV_ENV = "DDPD_RDZV"  # the agent's run id, in its environment (how another daemon on this host knows it)
AGENT_JOB_ENV = "DDPD_RDZV_JOB"  # the job it serves
CLOSE_WAIT = 5.0
# an agent's cgroup (``<job>-rdzv``); the sweep at the daemon's start ends those a killed run left
# (their agents died with it, PR_SET_PDEATHSIG; anything they started is killed there)
AGENTS = HelperKind("nodes", suffix="-rdzv", kill_wait=5.0)
MAX_STALE = 64  # replies to abandoned requests skipped in one call before the agent is called broken


@dataclass(frozen=True)
class AgentLaunch:
    """How this job's agent is started: as a cold rank of the job would be."""

    argv: tuple[str, ...]
    env: dict[str, str]
    run_as: Identity | None  # the submitter, when this (root) daemon starts it as another user
    state_dir: Path
    subtree: Subtree | None
    job_id: str
    owner_uid: int


def agent_launch(config: Config, job: Job, identity: Identity, run_as: Identity | None,
                 subtree: Subtree | None) -> AgentLaunch:
    if job.spec.python is not None:
        argv: tuple[str, ...] = (job.spec.python, "-m", "ddpd.worker")
    else:
        argv = config.worker_command or (sys.executable, "-m", "ddpd.worker")
    # not the ranks' DDPD_JOB_ID: the agent outlives each attempt (its own marker names the job)
    env = {**base_env(job.spec.environ, identity), AGENT_JOB_ENV: job.id, RDZV_ENV: job.spec.rdzv_id}
    return AgentLaunch(argv=argv, env=env, run_as=run_as, state_dir=config.state_dir, subtree=subtree,
                       job_id=job.id, owner_uid=job.owner_uid)


class RendezvousAgent:
    def __init__(self, proc: subprocess.Popen[bytes], sock: socket.socket, cgroup: Cgroup | None) -> None:
        sock.setblocking(False)
        self.proc, self.sock, self.cgroup = proc, sock, cgroup
        self._splitter = LineSplitter()
        self._decoder: Decoder[AgentReply] = Decoder(AgentReply)
        self._lock = anyio.Lock()
        self._ids = 0
        self._pending: list[AgentReply] = []

    @property
    def pid(self) -> int:
        return self.proc.pid

    @classmethod
    async def start(cls, launch: AgentLaunch) -> RendezvousAgent:
        """Spawn the agent (from the event-loop thread: its PR_SET_PDEATHSIG follows this thread)."""
        cgroup = None
        try:  # an agent always runs in its cgroup where there is a subtree: no cgroup, no agent
            if launch.subtree is not None:
                cgroup = await anyio.to_thread.run_sync(AGENTS.create, launch.subtree.jobs, launch.job_id)
            log_fd = await anyio.to_thread.run_sync(_open_log, launch)
        except OSError as exc:
            await AGENTS.aend(cgroup)
            raise NodeError(f"cannot start the rendezvous agent: {exc}") from None
        parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        argv = [*launch.argv, *worker_args(child_end.fileno(), os.getpid(), agent=True)]
        cwd = str(launch.state_dir) if launch.run_as is None else "/"
        try:
            proc = procs.spawn(argv, env=launch.env, cwd=cwd, log_fd=log_fd, pass_fds=[child_end.fileno()],
                               process_group=0, identity=launch.run_as,
                               place=None if cgroup is None else cgroup.add, what="the rendezvous agent's start")
        except OSError as exc:
            parent_end.close()
            await AGENTS.aend(cgroup)
            raise NodeError(f"cannot start the rendezvous agent: {exc}") from None
        finally:
            child_end.close()
            os.close(log_fd)
        log.info("nodes.agent_started", pid=proc.pid, uid=launch.owner_uid)
        return cls(proc, parent_end, cgroup)

    def next_id(self) -> int:
        self._ids += 1
        return self._ids

    async def call(self, request: AgentRequest, timeout: float, fds: Sequence[int] = ()) -> AgentReply:
        """Send `request` and wait (at most `timeout` s) for its reply; an AgentError reply, the
        agent's exit or a bad frame is a NodeError, the deadline a TimeoutError."""
        async with self._lock:
            with anyio.fail_after(timeout):
                await self._send(encode(request), fds)
                for _ in range(MAX_STALE + 1):  # answers to abandoned requests first, a few at most
                    reply = await self._next()
                    if reply.id == request.id:
                        break
                else:
                    raise NodeError(f"the rendezvous agent (pid {self.pid}) sent {MAX_STALE} frames that "
                                    "answer nothing asked")
        if isinstance(reply, AgentError):
            if reply.kind == "timeout":
                raise TimeoutError(reply.message)
            raise NodeError(reply.message)
        return reply

    async def _send(self, data: bytes, fds: Sequence[int]) -> None:
        view = memoryview(data)
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
        while view:
            try:
                sent = self.sock.sendmsg([view], rights) if rights else self.sock.send(view)
                rights = []
            except BlockingIOError:
                await anyio.wait_writable(self.sock)
                continue
            except OSError as exc:
                raise NodeError(f"the rendezvous agent (pid {self.pid}) is gone: {exc.strerror}") from None
            view = view[sent:]

    async def _next(self) -> AgentReply:
        await anyio.lowlevel.checkpoint()  # an agent that floods its channel cannot starve the loop
        while not self._pending:
            try:
                data = self.sock.recv(1 << 16)
            except BlockingIOError:
                await anyio.wait_readable(self.sock)
                continue
            except OSError:
                data = b""
            if not data:
                raise NodeError(f"the rendezvous agent (pid {self.pid}) exited (see {AGENT_LOG})")
            try:
                self._pending.extend(self._decoder.decode_frame(line) for line in self._splitter.feed(data))
            except FrameError as exc:
                raise NodeError(f"the rendezvous agent (pid {self.pid}) sent a bad frame: {exc.message}") from None
        return self._pending.pop(0)

    async def close(self) -> None:
        """End the agent (its group, its cgroup) and reap it; never raises."""
        self.sock.close()
        await helpers.close(AGENTS, self.proc, self.cgroup, CLOSE_WAIT)
        log.info("nodes.agent_stopped", pid=self.pid, exit=self.proc.poll())


def _open_log(launch: AgentLaunch) -> int:
    if launch.run_as is None:
        return procs.open_log(launch.state_dir / AGENT_LOG)
    return create_user_file(launch.state_dir, launch.run_as, name=AGENT_LOG)
