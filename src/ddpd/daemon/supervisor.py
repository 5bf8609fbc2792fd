"""One attempt of one job: rendezvous, spawn, watch every rank, decide, tear down.

Everything here is driven by events: frames on a rank's channel, a rank's pidfd turning
readable, and one timer that sleeps until the earliest deadline. Teardown always runs,
shielded, and ends only when no process of the attempt is left.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import msgspec
import structlog

from ..protocol import FrameError, JobState, RankState, TransitionError
from ..protocol.channel import (
    Assign,
    Checkpointed,
    DumpStacks,
    Failure,
    Heartbeat,
    Hello,
    PhaseChanged,
    Progress,
    Result,
    Stop,
)
from ..protocol.control import RootCause
from . import procs
from .channel import WorkerChannel
from .config import Config
from .jobs import Job, Journal, Rank, attempt_dir, job_dir, rank_log
from .pool import WarmPool, pool_eligible
from .rendezvous import Rendezvous, RendezvousError, open_rendezvous
from .rootcause import Evidence, StackSite, explain_hang, locate, pick_root_cause

log = structlog.get_logger("ddpd")

UNKILLABLE_WAIT = 5.0  # after SIGKILL: how long to wait before reporting a process as unkillable
MAX_STEP = 2**63 - 1  # a step counter SQLite can store
STACK_DUMP_WAIT = 1.0
MISSED_HEARTBEATS = 2  # rank.heartbeat_missed once a rank is silent for more than this many intervals


@dataclass
class Outcome:
    state: JobState
    reason: str
    root_cause: RootCause | None = None
    hang: bool = False  # dump stacks before teardown
    graceful: bool = False  # ask ranks to stop at a step boundary first


@dataclass
class Handle:
    rank: Rank
    proc: subprocess.Popen[bytes]
    channel: WorkerChannel
    exited: anyio.Event = field(default_factory=anyio.Event)
    reader_done: anyio.Event = field(default_factory=anyio.Event)
    exit: procs.Exit | None = None
    result: Result | None = None
    failure: Failure | None = None
    failed_at: float | None = None
    state_at_failure: str | None = None
    signals_before_exit: frozenset[str] = frozenset()
    last_progress_event: float = 0.0
    missed_reported: float | None = None  # the last_frame whose silence was reported as heartbeat_missed
    pooled: bool = False  # a warm-pool worker: joins the group itself (Assign.pgid), verified from /proc


def boot_ticks() -> int:
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * os.sysconf("SC_CLK_TCK"))


class Attempt:
    def __init__(self, config: Config, journal: Journal, job: Job, number: int, timeouts: dict[str, Any],
                 pool: WarmPool | None = None) -> None:
        self.config = config
        self.pool = pool  # the daemon's warm pool, None when it keeps none
        self.journal = journal
        self.job = job
        self.number = number
        self.timeouts = timeouts
        self.handles: list[Handle] = []
        self.pgid: int | None = None
        self.token = secrets.token_hex(8)
        self.marker = f"DDPD_ATTEMPT={job.id}:{number}:{self.token}"
        self.outcome: Outcome | None = None
        self._concluded = anyio.Event()
        self._replan = anyio.Event()  # set when a deadline may have appeared or moved earlier
        self._warned = False  # the ranks were asked to stop before the wall-time limit
        self.stack_sites: dict[int, StackSite] = {}  # rank -> where its main thread hung (from its dump)
        self._signals_sent: set[str] = set()
        self._started = time.monotonic()
        self._start_ticks = boot_ticks()
        self.dir = attempt_dir(config.state_dir, job.id, number)
        self.checkpoint_dir = job_dir(config.state_dir, job.id) / "checkpoints"
        self.log = log.bind(job_id=job.id, attempt=number)

    # -- decisions -------------------------------------------------------------------------

    def conclude(self, outcome: Outcome) -> None:
        """The first conclusion wins; later ones (collateral) are ignored."""
        if self.outcome is None:
            self.outcome = outcome
            self._concluded.set()

    def request_cancel(self, reason: str, force: bool) -> None:
        self.conclude(Outcome(JobState.CANCELLED, reason, graceful=not force))
        if force:
            self._signal_group(signal.SIGKILL)

    def request_shutdown(self) -> None:
        """The daemon is stopping: stop at a step boundary (checkpoint) and go back to the queue."""
        self.conclude(Outcome(JobState.QUEUED, "daemon_shutdown", graceful=True))

    def force(self) -> None:
        """A second stop signal: no more grace."""
        self.conclude(Outcome(JobState.QUEUED, "daemon_shutdown"))
        self._signal_group(signal.SIGKILL)

    # -- the attempt -----------------------------------------------------------------------

    async def run(self) -> Outcome:
        job = self.job
        try:
            rdzv = await open_rendezvous(self.config.store_host, self.config.port_range, job.spec.nproc)
        except RendezvousError as exc:
            return Outcome(JobState.FAILED, "rendezvous", RootCause(reason="rendezvous", detail=str(exc)))
        job.store_port = rdzv.port
        await self.journal.event(job, "job.rendezvous", host=rdzv.host, port=rdzv.port)
        try:
            async with anyio.create_task_group() as tg:
                try:
                    await self._spawn_all(tg, rdzv)
                    tg.start_soon(self._timers)
                    await self._concluded.wait()
                finally:
                    with anyio.CancelScope(shield=True):
                        if self.outcome is None:  # cancelled from outside: the daemon is stopping
                            self.conclude(Outcome(JobState.QUEUED, "daemon_shutdown", graceful=True))
                        await self._teardown()
                        tg.cancel_scope.cancel()
        finally:
            for h in self.handles:
                h.channel.close()
            rdzv.close()
        assert self.outcome is not None
        return self._finish_outcome(self.outcome)

    def _finish_outcome(self, outcome: Outcome) -> Outcome:
        if outcome.state is JobState.FAILED and outcome.root_cause is None:
            outcome.root_cause = pick_root_cause(self._evidence(), self.number, outcome.reason)
        if outcome.hang and outcome.root_cause is not None:
            outcome.root_cause = explain_hang(outcome.root_cause, self.stack_sites)
        return outcome

    def _evidence(self) -> list[Evidence]:
        return [
            Evidence(
                rank=h.rank.rank,
                state=h.state_at_failure or h.rank.state.value,
                exit=h.exit,
                failure=h.failure,
                failed_at=h.failed_at,
                signals_sent_before_exit=h.signals_before_exit,
            )
            for h in self.handles
        ]

    # -- spawning --------------------------------------------------------------------------

    def _env(self, rank: int, rdzv: Rendezvous) -> dict[str, str]:
        spec = self.job.spec
        n = spec.nproc
        env = dict(os.environ)
        for key in ("NOTIFY_SOCKET", "LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES", "WATCHDOG_USEC", "WATCHDOG_PID"):
            env.pop(key, None)
        env.update(
            {
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
                "TORCHELASTIC_RESTART_COUNT": str(self.number - 1),
                "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
                "TORCHELASTIC_RUN_ID": self.job.id,
                "TORCHELASTIC_ERROR_FILE": str(self.dir / f"rank-{rank}-error.json"),
                "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
                "DDPD_JOB_ID": self.job.id,
                "PYTHONUNBUFFERED": "1",
            }
        )
        env["DDPD_ATTEMPT"] = self.marker.split("=", 1)[1]
        if not self.job.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ""  # a CPU job never touches a GPU the scheduler gave another job
        elif spec.script is not None:
            # torchrun's layout: every rank sees the job's GPUs and `cuda:LOCAL_RANK` is its own
            # (rank r's are devices r*k .. r*k+k-1 with k = gpus_per_rank)
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in self.job.gpus)
        else:  # the built-in loop: each rank sees only its own GPUs, as cuda:0..
            per = spec.gpus_per_rank
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in self.job.gpus[rank * per : (rank + 1) * per])
        if "OMP_NUM_THREADS" not in spec.env:
            env["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // n))
        env.update(spec.env)
        return env

    async def _spawn_all(self, tg: anyio.abc.TaskGroup, rdzv: Rendezvous) -> None:
        job = self.job
        await anyio.to_thread.run_sync(lambda: self.dir.mkdir(parents=True, exist_ok=True))
        await anyio.to_thread.run_sync(lambda: self.checkpoint_dir.mkdir(parents=True, exist_ok=True))
        cwd = job.spec.workdir or str(job_dir(self.config.state_dir, job.id))
        pool = self.pool if self.pool is not None and pool_eligible(job.spec) is None else None
        for r in range(job.spec.nproc):
            if self.outcome is not None:
                return
            log_path = rank_log(self.config.state_dir, job.id, self.number, r)
            taken = pool.take() if pool is not None else None
            if taken is not None:
                await self._adopt(tg, rdzv, r, log_path, *taken)
                continue
            env = self._env(r, rdzv)
            parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            argv = [*(self.config.worker_command or (sys.executable, "-m", "ddpd.worker")),
                    "--fd", str(child_end.fileno()), "--parent", str(os.getpid())]
            try:
                proc = procs.spawn(
                    argv, env=env, cwd=cwd, log_path=log_path, pass_fds=[child_end.fileno()],
                    process_group=self.pgid or 0,
                )
            except OSError as exc:
                parent_end.close()
                child_end.close()
                self.conclude(Outcome(JobState.FAILED, "spawn_failed",
                                      RootCause(reason="spawn_failed", rank=r, attempt=self.number,
                                                detail=f"cannot start rank {r}: {exc}")))
                return
            child_end.close()
            if self.pgid is None:
                self.pgid = proc.pid
            rank = Rank(rank=r, attempt=self.number, pid=proc.pid, pgid=self.pgid, log=str(log_path))
            job.ranks.append(rank)
            handle = Handle(rank=rank, proc=proc, channel=WorkerChannel(parent_end))
            self.handles.append(handle)
            await self.journal.save_rank(job, rank)
            await self.journal.event(job, "rank.spawned", rank=r, pid=proc.pid, pgid=self.pgid, log=str(log_path))
            tg.start_soon(self._read, handle, rdzv)
            tg.start_soon(self._watch_exit, handle)
        await self.journal.save_attempt(job, self.number, pgid=self.pgid, store_port=rdzv.port, token=self.token)

    async def _adopt(self, tg: anyio.abc.TaskGroup, rdzv: Rendezvous, r: int, log_path: Path,
                     proc: subprocess.Popen[bytes], channel: WorkerChannel, hello: Hello) -> None:
        """Rank `r` is a warm-pool worker that already said hello (it was CONNECTED in the pool).

        It leads its own process group: as the attempt's first rank it becomes the attempt's
        group (Assign.pgid = its pid, a no-op), else it joins the leader's with setpgid on
        Assign, checked against /proc when it reports store_connected. Until then group signals
        may miss it, so `_signal_group` signals pooled ranks by pid too. Its stdout/stderr move
        to `log_path` on Assign (Assign.log_path); the worker creates the file.
        """
        job = self.job
        if self.pgid is None:
            self.pgid = proc.pid
        rank = Rank(rank=r, attempt=self.number, pid=proc.pid, pgid=self.pgid, log=str(log_path))
        job.ranks.append(rank)
        handle = Handle(rank=rank, proc=proc, channel=channel, pooled=True)
        self.handles.append(handle)
        tg.start_soon(self._watch_exit, handle)
        await self.journal.save_rank(job, rank)
        await self.journal.event(job, "rank.spawned", rank=r, pid=proc.pid, pgid=self.pgid, log=str(log_path),
                                 pooled=True)
        tg.start_soon(self._connected_then_read, handle, hello, rdzv)

    async def _connected_then_read(self, h: Handle, hello: Hello, rdzv: Rendezvous) -> None:
        await self._connected(h, hello, rdzv)
        await self._read(h, rdzv)

    async def _connected(self, h: Handle, hello: Hello, rdzv: Rendezvous) -> None:
        """The rank said hello (to the attempt, or earlier to the pool): record it, send the assignment."""
        await self.journal.rank_state(self.job, h.rank, RankState.CONNECTED, "rank.connected",
                                      worker_pid=hello.pid, protocol=hello.version, torch=hello.torch,
                                      pooled=h.pooled)
        await h.channel.send(self._assign(h, rdzv))

    def _check_pgid(self, h: Handle) -> None:
        """A pooled rank moved itself into the attempt's group: verify it (the daemon cannot, after exec)."""
        info = procs.proc_info(h.proc.pid)
        if info is not None and h.proc.returncode is None and info.pgid != self.pgid:
            raise FrameError("pgid_mismatch", f"rank {h.rank.rank} (pid {h.proc.pid}) is in process group "
                                              f"{info.pgid}, not the attempt's {self.pgid}")

    # -- per-rank watchers -----------------------------------------------------------------

    def _fail(self, h: Handle) -> None:
        if h.failed_at is None:
            h.failed_at = time.monotonic()
            h.state_at_failure = h.rank.state.value

    async def _read(self, h: Handle, rdzv: Rendezvous) -> None:
        rank = h.rank
        job = self.job
        try:
            async for msg in h.channel.frames():
                now = time.monotonic()
                rank.last_frame = now
                if not 0 <= getattr(msg, "step", getattr(msg, "steps", 0)) <= MAX_STEP:
                    # msgspec takes any 64-bit integer; SQLite stores signed ones, so a step of 2**64-1
                    # would later fail a write (an internal error) instead of failing the rank now
                    raise FrameError("bad_message", f"step out of range in {type(msg).__name__} frame")
                if not isinstance(msg, Heartbeat | Progress):
                    self._replan.set()  # a hello or a phase change starts deadlines (heartbeat, progress)
                match msg:
                    case Heartbeat(step=step):
                        if step != rank.step:
                            rank.step = step
                            rank.last_step_change = now
                    case Progress(step=step, loss=loss):
                        rank.step, rank.loss, rank.last_step_change = step, loss, now
                        if rank.state is RankState.JOINED:
                            await self.journal.rank_state(job, rank, RankState.TRAINING)
                        if now - h.last_progress_event >= 0.2:
                            h.last_progress_event = now
                            await self.journal.event(job, "rank.progress", rank=rank.rank, persist=False,
                                                     step=step, loss=loss)
                    case Hello() as hello:
                        await self._connected(h, hello, rdzv)
                    case PhaseChanged(phase="store_connected"):
                        if h.pooled:
                            self._check_pgid(h)
                        await self.journal.rank_state(job, rank, RankState.STORE_CONNECTED, "rank.store_connected")
                    case PhaseChanged(phase="joined"):
                        rank.last_step_change = now
                        await self.journal.rank_state(job, rank, RankState.JOINED, "rank.joined",
                                                      seconds=round(now - rank.spawned_at, 3))
                        if all(r.state in (RankState.JOINED, RankState.TRAINING) for r in job.ranks) and (
                            len(job.ranks) == job.spec.nproc and job.state is JobState.STARTING
                        ):
                            await self.journal.job_state(job, JobState.RUNNING, "all ranks joined")
                    case PhaseChanged(phase="training"):
                        rank.last_step_change = now  # DDP is built: the progress clock starts over
                        if rank.state is RankState.JOINED:
                            await self.journal.rank_state(job, rank, RankState.TRAINING)
                    case PhaseChanged():
                        pass
                    case Checkpointed(step=step, path=path):
                        await self.journal.event(job, "job.checkpointed", rank=rank.rank, step=step, path=path)
                    case Result() as result:
                        h.result = result
                        rank.step = result.steps
                        rank.loss = result.loss if result.loss is not None else rank.loss
                        rank.checksum = result.checksum
                        await self.journal.event(job, "rank.result", rank=rank.rank, steps=result.steps,
                                                 loss=result.loss, checksum=result.checksum,
                                                 stopped_early=result.stopped_early)
                    case Failure() as failure:
                        h.failure = failure
                        self._fail(h)
                        await self.journal.event(job, "rank.failed", rank=rank.rank, error=failure.error,
                                                 message=failure.message, phase=failure.phase,
                                                 traceback=failure.traceback)
                        self.conclude(Outcome(JobState.FAILED, "rank_failed"))
        except (FrameError, TransitionError) as exc:
            message = exc.message if isinstance(exc, FrameError) else f"out-of-order frame: {exc}"
            self._fail(h)
            await self.journal.event(job, "rank.protocol_error", rank=rank.rank, message=message)
            self.conclude(Outcome(JobState.FAILED, "protocol_error",
                                  RootCause(reason="protocol_error", rank=rank.rank, attempt=self.number,
                                            phase=rank.state.value, detail=message)))
        finally:
            h.reader_done.set()

    def _assign(self, h: Handle, rdzv: Rendezvous) -> Assign:
        rank = h.rank
        spec = self.job.spec
        if h.pooled and not spec.workdir:  # a cold rank starts in the job's directory: so does a pooled one
            spec = msgspec.structs.replace(spec, workdir=str(job_dir(self.config.state_dir, self.job.id)))
        return Assign(
            job_id=self.job.id,
            attempt=self.number,
            rank=rank.rank,
            world_size=spec.nproc,
            local_rank=rank.rank,
            local_world_size=spec.nproc,
            store_host=rdzv.host,
            store_port=rdzv.port,
            spec=spec,
            env={k: v for k, v in self._env(rank.rank, rdzv).items() if k not in os.environ or
                 os.environ[k] != v},
            heartbeat_interval=self.config.heartbeat_interval,
            join_timeout=float(self.timeouts["join"]),
            checkpoint_dir=str(self.checkpoint_dir),
            pgid=(self.pgid or 0) if h.pooled else 0,
            log_path=(rank.log or "") if h.pooled else "",
        )

    async def _watch_exit(self, h: Handle) -> None:
        exit_ = await procs.wait_exit(h.proc)
        h.signals_before_exit = frozenset(self._signals_sent)
        with anyio.move_on_after(1.0):  # frames sent just before exiting (the result) are read first
            await h.reader_done.wait()
        h.exit = exit_
        rank = h.rank
        rank.exit_code, rank.signal = exit_.code, exit_.signal
        if not exit_.ok:
            self._fail(h)
        h.exited.set()
        if not exit_.ok:  # decided before the journal write: teardown of the peers starts at once
            self.conclude(Outcome(JobState.FAILED, "rank_failed"))
        await self.journal.rank_state(self.job, rank, RankState.EXITED, "rank.exited",
                                      exit_code=exit_.code, signal=exit_.signal)
        if exit_.ok and len(self.handles) == self.job.spec.nproc and all(
                x.exit is not None and x.exit.ok for x in self.handles):
            stopped = any(x.result is not None and x.result.stopped_early for x in self.handles)
            if stopped and self.job.cancel_requested:
                self.conclude(Outcome(JobState.CANCELLED, self.job.cancel_requested))
            elif stopped and self._warned:
                step = max(x.rank.step for x in self.handles)
                self.conclude(Outcome(JobState.TIMED_OUT, "wall_time", RootCause(
                    reason="wall_time", attempt=self.number,
                    detail=f"stopped at step {step} on the wall-time warning, {self._stop_warning_lead():.0f}s "
                           f"before the {float(self.timeouts['wall']):.0f}s limit")))
            else:
                self.conclude(Outcome(JobState.SUCCEEDED, "all ranks succeeded"))

    # -- deadlines -------------------------------------------------------------------------

    def _check_deadlines(self, now: float) -> tuple[float | None, Outcome | None]:
        """The earliest pending deadline, or the outcome of one that has passed."""
        t = self.timeouts
        deadlines: list[float] = []
        live = [h for h in self.handles if h.exit is None]
        joined = (RankState.JOINED, RankState.TRAINING, RankState.EXITED)
        pending = [h for h in live if h.rank.state not in joined]
        if pending or len(self.handles) < self.job.spec.nproc:
            at = self._started + t["join"]
            if now >= at:
                return None, self._join_timeout(pending)
            deadlines.append(at)
        for h in live:
            if h.rank.last_frame is not None:
                at = h.rank.last_frame + t["heartbeat"]
                if now >= at:
                    return None, Outcome(JobState.TIMED_OUT, "heartbeat_timeout",
                                         RootCause(reason="heartbeat_timeout", attempt=self.number,
                                                   rank=h.rank.rank, phase=h.rank.state.value,
                                                   detail=f"rank {h.rank.rank} sent nothing for "
                                                          f"{now - h.rank.last_frame:.1f}s"), hang=True)
                deadlines.append(at)
        # the step counter is watched once a rank trains; a script that never reports steps is not watched
        watched = (RankState.TRAINING,) if self.job.spec.script is not None else (RankState.JOINED, RankState.TRAINING)
        stalled = [h for h in live if h.rank.state in watched and h.rank.last_step_change is not None]
        if stalled:

            def limit(h: Handle) -> float:
                # between joining and the first step a rank sets up (optimizer, checkpoint, DDP): under
                # load that outlasts a short progress timeout, so it gets at least the join timeout
                return float(t["progress"] if h.rank.state is RankState.TRAINING else max(t["progress"], t["join"]))

            low = min(h.rank.step for h in stalled)
            at = min((h.rank.last_step_change or 0.0) + limit(h) for h in stalled)
            if now >= at:
                overdue = [h for h in stalled if (h.rank.last_step_change or 0.0) + limit(h) <= now]
                stuck = [h.rank.rank for h in overdue]
                return None, Outcome(JobState.TIMED_OUT, "progress_timeout",
                                     RootCause(reason="progress_timeout", attempt=self.number, ranks=stuck,
                                               rank=stuck[0], phase=overdue[0].rank.state.value,
                                               detail=f"step counter of rank(s) {stuck} frozen at {low} for "
                                                      f"{limit(overdue[0]):.0f}s"), hang=True)
            deadlines.append(at)
        if (at := self._wall_at(now)) is not None:
            if now >= at:
                return None, Outcome(JobState.TIMED_OUT, "wall_time",
                                     RootCause(reason="wall_time", attempt=self.number,
                                               detail=f"wall time of {t['wall']:.0f}s reached"))
            deadlines.append(at)
        return (min(deadlines) if deadlines else None), None

    def _wall_at(self, now: float) -> float | None:
        """When (monotonic) the job's wall time, counted from its first start, runs out."""
        wall = self.timeouts.get("wall")
        if wall is None or self.job.started_at is None:
            return None
        return now + float(wall) - (time.time() - self.job.started_at)

    def _stop_warning_lead(self) -> float:
        """How long before the wall-time limit the ranks are asked to stop: `stop_warning`, but never
        more than half the wall time (a daemon default of 30 s must not stop a 20 s job at its start)."""
        return min(float(self.timeouts["stop_warning"]), float(self.timeouts["wall"]) / 2)

    def _stop_warning_at(self, now: float) -> float | None:
        at = self._wall_at(now)
        return None if at is None or self._warned else at - self._stop_warning_lead()

    async def _warn_stop(self, now: float) -> None:
        """Before the wall-time limit (as Slurm's --signal): every rank is asked to stop at a step
        boundary and checkpoint. Ranks that then exit 0 end the job TIMED_OUT (wall_time) at once;
        ranks that do not stop are torn down when the wall time runs out."""
        self._warned = True
        left = (self._wall_at(now) or now) - now
        for h in self._live():
            await h.channel.send(Stop(reason="wall_time_warning"))
        await self.journal.event(self.job, "job.stop_warning", reason="wall_time_warning",
                                 seconds_left=round(left, 3), wall=float(self.timeouts["wall"]))

    def _join_timeout(self, pending: list[Handle]) -> Outcome:
        """Name the ranks furthest behind; ranks already in init_process_group are only waiting for them."""
        order = list(RankState)
        missing = self.job.spec.nproc - len(self.handles)
        behind = min((order.index(h.rank.state) for h in pending), default=0)
        culprits = [h for h in pending if order.index(h.rank.state) == behind]
        parts = [f"rank {h.rank.rank} never joined (reached {h.rank.state.value})" for h in culprits]
        parts += [f"rank {h.rank.rank} waiting in init_process_group ({h.rank.state.value})"
                  for h in pending if h not in culprits]
        if missing:
            parts.append(f"{missing} rank(s) never spawned")
        ranks = [h.rank.rank for h in culprits]
        return Outcome(JobState.TIMED_OUT, "join_timeout",
                       RootCause(reason="join_timeout", attempt=self.number, ranks=ranks,
                                 rank=ranks[0] if ranks else None,
                                 phase=culprits[0].rank.state.value if culprits else None,
                                 detail=f"join timeout after {self.timeouts['join']:.0f}s: " + "; ".join(parts)),
                       hang=True)

    def _overdue(self, now: float) -> tuple[list[Handle], float | None]:
        """Live ranks silent for more than MISSED_HEARTBEATS intervals (once per silence), and when the next is."""
        late = MISSED_HEARTBEATS * self.config.heartbeat_interval
        overdue: list[Handle] = []
        next_at: float | None = None
        for h in self.handles:
            last = h.rank.last_frame
            if h.exit is not None or last is None or h.missed_reported == last:
                continue
            if now >= last + late:
                overdue.append(h)
            elif next_at is None or last + late < next_at:
                next_at = last + late
        return overdue, next_at

    async def _timers(self) -> None:
        while self.outcome is None:
            self._replan = anyio.Event()
            now = time.monotonic()
            next_at, outcome = self._check_deadlines(now)
            if outcome is not None:
                self.conclude(outcome)
                return
            overdue, warn_at = self._overdue(now)
            for h in overdue:
                h.missed_reported = h.rank.last_frame
                await self.journal.event(self.job, "rank.heartbeat_missed", rank=h.rank.rank,
                                         silent=round(now - (h.rank.last_frame or now), 3),
                                         interval=self.config.heartbeat_interval,
                                         timeout=float(self.timeouts["heartbeat"]), state=h.rank.state.value)
            if warn_at is not None and (next_at is None or warn_at < next_at):
                next_at = warn_at
            stop_at = self._stop_warning_at(now)
            if stop_at is not None and now >= stop_at:
                await self._warn_stop(now)
                continue
            if stop_at is not None and (next_at is None or stop_at < next_at):
                next_at = stop_at
            # sleep until the earliest deadline (re-checked then: a heartbeat may have moved it later),
            # or until a frame starts a new deadline that may come sooner (bug: a 4 s progress timeout
            # used to wait for the 120 s join deadline the timer had gone to sleep on)
            with anyio.move_on_after(max(0.01, (next_at - now) if next_at is not None else 1.0)):
                await self._replan.wait()

    # -- teardown --------------------------------------------------------------------------

    def _live(self) -> list[Handle]:
        return [h for h in self.handles if not h.exited.is_set()]

    async def _wait_all_exited(self, timeout: float) -> bool:
        with anyio.move_on_after(timeout):
            for h in self.handles:
                await h.exited.wait()
            return True
        return False

    def _signal_group(self, signum: signal.Signals) -> None:
        self._signals_sent.add(signum.name)
        if self.pgid is not None:
            procs.kill_group(self.pgid, signum)
        for h in self.handles:  # a pooled rank may not have joined the group yet
            if h.pooled and h.proc.returncode is None:  # not reaped: the pid is still ours
                try:
                    os.kill(h.proc.pid, signum)
                except ProcessLookupError:
                    pass

    async def _await_dumps(self, handles: list[Handle], sizes: dict[int, int]) -> None:
        """Bounded: faulthandler answers nothing, so watch the logs until each holds a whole
        main-thread stack (a dump is written line by line)."""
        deadline = time.monotonic() + STACK_DUMP_WAIT
        while time.monotonic() < deadline:
            for h in handles:
                if h.rank.rank not in self.stack_sites:
                    site = locate(h.rank.rank, _tail(h.rank.log, sizes[h.rank.rank]))
                    if site is not None:
                        self.stack_sites[h.rank.rank] = site
            if all(h.rank.rank in self.stack_sites for h in handles):
                return
            await anyio.sleep(0.02)

    async def _dump_stacks(self) -> None:
        live = self._live()
        sizes = {h.rank.rank: _size(h.rank.log) for h in live}
        for h in live:  # faulthandler's C handler: answers even while a C call holds the GIL
            try:
                os.kill(h.proc.pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        await self._await_dumps(live, sizes)
        # then the reader thread, for ranks whose SIGUSR1 did not dump (a script may take SIGUSR1);
        # one after the other, so that two dumps never interleave in one log
        late = [h for h in live if h.rank.rank not in self.stack_sites]
        for h in late:
            await h.channel.send(DumpStacks())
        await self._await_dumps(late, sizes)
        dumped = [h.rank.rank for h in live if _size(h.rank.log) > sizes[h.rank.rank]]
        for h in live:
            h.rank.stack_dump = h.rank.rank in dumped
            await self.journal.save_rank(self.job, h.rank)
        await self.journal.event(self.job, "job.stacks_dumped", ranks=dumped,
                                 logs={str(h.rank.rank): h.rank.log for h in live},
                                 where={str(r): site.describe() for r, site in sorted(self.stack_sites.items())})

    async def _teardown(self) -> None:
        assert self.outcome is not None
        outcome = self.outcome
        grace = float(self.timeouts["kill_grace"])
        t0 = time.monotonic()
        if self._live() and outcome.graceful:
            for h in self._live():
                await h.channel.send(Stop(reason=outcome.reason))
            await self.journal.event(self.job, "job.stop_requested", reason=outcome.reason, grace=grace)
            await self._wait_all_exited(grace)
        if self._live() and outcome.hang:
            await self._dump_stacks()
        if self._live():
            await self.journal.event(self.job, "job.teardown", signal="SIGTERM", grace=grace,
                                     pgid=self.pgid, reason=outcome.reason)
            self._signal_group(signal.SIGTERM)
            self._signal_group(signal.SIGCONT)  # a stopped rank (SIGSTOP) acts on SIGTERM only once continued
            if not await self._wait_all_exited(grace):
                await self.journal.event(self.job, "job.teardown", signal="SIGKILL", pgid=self.pgid,
                                         ranks=[h.rank.rank for h in self._live()])
                self._signal_group(signal.SIGKILL)
                if not await self._wait_all_exited(UNKILLABLE_WAIT):
                    for h in self._live():
                        info = procs.proc_info(h.proc.pid)
                        await self.journal.event(self.job, "rank.unkillable", rank=h.rank.rank, pid=h.proc.pid,
                                                 proc_state=info.state if info else "?")
        await self._kill_leftovers()
        await self.journal.event(self.job, "job.torn_down", seconds=round(time.monotonic() - t0, 3),
                                 reason=outcome.reason)

    async def _kill_leftovers(self) -> None:
        """Descendants still alive (in the group, or escaped with setsid but carrying the marker)."""
        marker = self.marker.encode()
        tracked = {h.proc.pid for h in self.handles if not h.exited.is_set()}
        members = await anyio.to_thread.run_sync(procs.find_members, self.pgid, marker)
        leftovers = [
            p for p in members
            if p.pid not in tracked and p.state != "Z" and (
                procs.proc_environ_has(p.pid, marker) or p.start_time >= self._start_ticks
            )
        ]
        for p in leftovers:
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if leftovers:
            with anyio.move_on_after(UNKILLABLE_WAIT):
                for p in leftovers:
                    procs.reap_zombie_children({h.proc.pid for h in self.handles})
                    await procs.wait_gone(p.pid)
            await self.journal.event(self.job, "job.leftover_killed", pids=[p.pid for p in leftovers])
        procs.reap_zombie_children({h.proc.pid for h in self.handles})


def _tail(path: str | None, start: int, limit: int = 1 << 20) -> str:
    """What a log gained since offset `start` (at most `limit` bytes)."""
    if path is None:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(start)
            return f.read(limit).decode("utf-8", "replace")
    except OSError:
        return ""


def _size(path: str | None) -> int:
    if path is None:
        return 0
    try:
        return Path(path).stat().st_size
    except OSError:
        return 0
