"""One attempt of one job: rendezvous, launch, watch every rank, decide, tear down.

The attempt's story, told by the modules it composes: `rendezvous` binds the store's port before
any rank starts; the attempt row and its marker are saved (journal) before the first rank is
spawned; `launch` starts each rank (cold or from the warm pool) with an environment built once;
`ranks` turns each rank's frames and exit into its state; `deadlines` says when a timeout is due
and the attempt sleeps on its `Clock` until then (or until a frame moves a deadline); the first
conclusion wins (the rest is collateral); `teardown` escalates against one deadline over the
attempt's `gang`, shielded, and ends only when no process of the attempt is left.

A multi-node attempt (`nodes`, the job's `NodeSession`) forms through torch's elastic rendezvous
instead of binding its own store (unless it is node rank 0), starts this node's ranks at their
global ranks (`layout`), runs the node watch beside its ranks (`multinode.watch_nodes`), and after
the teardown settles the root cause with the other nodes (`multinode.settle`).

Every rank's tasks are bound to ``job_id``, ``attempt`` and ``rank`` in structlog's contextvars.
"""

from __future__ import annotations

import functools
import os
import secrets
import signal
import time
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread
import structlog
from structlog.contextvars import bound_contextvars

from ...protocol import FrameError, RankState
from ...protocol.channel import Hello, Release, Stop
from ...protocol.control import RootCause, StacksResult
from ...protocol.limits import clip_text
from ...protocol.spec import hot_replacements
from ...protocol.worker import attempt_marker, marker_entry
from ..config import Config, JobTimeouts
from ..contain import procs
from ..contain.cgroups import AttemptCgroup, Subtree
from ..contain.identity import Identity, UnknownUser
from ..contain.joblimits import LimitsOutcome, apply_limits, wanted
from ..contain.portfence import PortOwner, daemon_tag
from ..contain.usertree import open_user_file
from ..gpu.rankenv import rank_defaults
from ..layout import checkpoint_dir, rank_log_name, stderr_log, user_attempt_dir, user_job_dir
from ..multinode.agentproc import agent_launch
from ..multinode.multinode import settle, watch_nodes
from ..multinode.nodes import NodeLayout, NodeSession
from ..pool.pool import WarmPool
from ..ranklogs.keeper import LogKeeper, keep_logs
from ..ranklogs.workspace import create_logs, live_streams, prepare_dirs
from ..run.clock import Clock, RealClock, wait_until
from ..run.outcome import AttemptEnd, Outcome, settle_stop
from ..run.rendezvous import Rendezvous, RendezvousError, close_rendezvous, hand_over, open_rendezvous
from ..run.rootcause import Evidence, explain_hang, pick_root_cause
from ..store.journal import Journal
from ..store.records import Job
from .deadlines import Limits, Watch, check
from .gang import RankGang
from .launch import LaunchContext, Launcher
from .ranks import RankHandle, finished_outcome, read_frames, watch_exit
from .replace import Replacements, reform
from .stacks import collect, find_py_spy
from .teardown import escalate

log = structlog.get_logger("ddpd")

TIMER_GRAIN = 0.25  # seconds: a deadline is met within this (the timer sleeps as long, unless a frame replans)

__all__ = ["Attempt", "Outcome"]


def _write_each(fds: tuple[int, int], data: bytes) -> None:
    for fd in fds:
        os.write(fd, data)


def boot_ticks() -> int:
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * os.sysconf("SC_CLK_TCK"))


class Attempt:
    def __init__(self, config: Config, journal: Journal, job: Job, number: int, timeouts: JobTimeouts,
                 pool: WarmPool | None = None, clock: Clock | None = None, subtree: Subtree | None = None,
                 nodes: NodeSession | None = None) -> None:
        self.config = config
        self.nodes = nodes  # a multi-node job's session (its rendezvous across nodes); None: one node
        self.layout: NodeLayout | None = None
        self.subtree = subtree  # the daemon's cgroup subtree: each attempt gets a cgroup of its own there
        self.pool = pool  # the daemon's warm pool, None when it keeps none
        self.journal = journal
        self.job = job
        self.number = number
        self.timeouts = timeouts
        self.clock: Clock = clock or RealClock()
        self.frame_rate = float(config.rank_frames_per_second)
        self.token = secrets.token_hex(8)
        self.marker = attempt_marker(job.id, number, self.token)
        self.outcome: Outcome | None = None
        self.gang = RankGang(job, journal, self.clock, marker_entry(job.id, number, self.token), boot_ticks(),
                             opener=functools.partial(open_user_file, config.state_dir, job.owner_uid))
        if job.spec.script is not None and config.stop_signal != "none":  # built-in tasks stop by the API alone
            self.gang.stop_signal = signal.Signals[config.stop_signal].value
        self._concluded = anyio.Event()
        self._replan = anyio.Event()  # set when a deadline may have appeared or moved earlier
        self._warned = False  # the ranks were asked to stop before the wall-time limit
        self._started = self.clock.monotonic()
        self._started_wall = self.clock.time()
        self._launcher: Launcher | None = None
        self.limits = Limits(join=timeouts.join, heartbeat=timeouts.heartbeat, progress=timeouts.progress,
                             heartbeat_interval=config.heartbeat_interval, wall=timeouts.wall,
                             stop_warning=timeouts.stop_warning, failed_exit=timeouts.kill_grace)
        # the owner's tree (usertree, layout): <state_dir>/users/<uid>/jobs/<job>/{attempt-<n>,checkpoints}
        self.job_dir = user_job_dir(config.state_dir, job.owner_uid, job.id)
        self.dir = user_attempt_dir(config.state_dir, job.owner_uid, job.id, number)
        self.checkpoint_dir = checkpoint_dir(config.state_dir, job.owner_uid, job.id)
        self.identity: Identity | None = None
        self.log = log.bind(job_id=job.id, attempt=number)
        self.replacements = Replacements(job, store_host_rank=None)
        self._tg: anyio.abc.TaskGroup | None = None

    @property
    def offset(self) -> int:
        """The global rank of this node's local rank 0 (0 on one node)."""
        return 0 if self.layout is None else self.layout.offset

    @property
    def handles(self) -> list[RankHandle]:
        return self.gang.handles

    @property
    def pgid(self) -> int | None:
        return self.gang.pgid

    # -- decisions (the RankContext of the ranks' tasks) ------------------------------------

    def conclude(self, outcome: Outcome) -> None:
        """The first conclusion wins; later ones (collateral) are ignored."""
        if self.outcome is None:
            self.outcome = outcome
            self._concluded.set()

    def replan(self) -> None:
        self._replan.set()

    def signals_sent(self) -> frozenset[str]:
        return frozenset(self.gang.signals_sent)

    def reported_failure(self) -> bool:
        """Whether a rank of this attempt has sent its failure (it may not have exited yet)."""
        return any(h.failure is not None for h in self.handles)

    def exit_outcome(self) -> Outcome | None:
        return finished_outcome(self.handles, self.job.spec.nproc, self.job.spec.script is not None, self.number,
                                cancel_requested=self.job.cancel_requested, warned=self._warned,
                                stop_warning_lead=self.limits.stop_warning_lead, wall=self.limits.wall)

    def request_cancel(self, reason: str, force: bool) -> None:
        self.conclude(Outcome(AttemptEnd.CANCELLED, reason, graceful=not force))
        if force:
            self.gang.signal_now(signal.SIGKILL)

    def gpu_fault(self, detail: str) -> None:
        """A GPU the attempt holds was quarantined (queue.gpuhealth): the attempt fails with it as the
        root cause ("GPU 3 (GPU-...): Xid 79, fell off the bus"); its ranks are torn down."""
        self.conclude(Outcome(AttemptEnd.FAILED, "gpu_fault", RootCause(reason="gpu_fault", attempt=self.number,
                                                                        detail=detail)))

    def request_shutdown(self) -> None:
        """The daemon is stopping: stop at a step boundary (checkpoint) and go back to the queue."""
        self.conclude(Outcome(AttemptEnd.DAEMON_STOPPING, "daemon_shutdown", graceful=True))

    def force(self) -> None:
        """A second stop signal: no more grace."""
        self.conclude(Outcome(AttemptEnd.DAEMON_STOPPING, "daemon_shutdown"))
        self.gang.signal_now(signal.SIGKILL)

    # -- the attempt -----------------------------------------------------------------------

    def run_as(self) -> Identity | None:
        """The user the ranks switch to: the submitter, when this daemon is root and they are not."""
        euid = os.geteuid()
        if self.identity is None or euid != 0 or self.identity.uid == euid:
            return None
        return self.identity

    async def run(self) -> Outcome:
        job = self.job
        try:
            self.identity = await anyio.to_thread.run_sync(Identity.of, job.owner_uid)
        except UnknownUser as exc:
            return Outcome(AttemptEnd.FAILED, "spawn_failed", RootCause(reason="spawn_failed", attempt=self.number,
                                                                      detail=str(exc)))
        try:
            if self.nodes is not None:
                launch = agent_launch(self.config, job, self.identity, self.run_as(), self.subtree)
                rdzv, self.layout = await self.nodes.form(self.number, job.spec.nproc, launch, self.port_owner())
            else:
                rdzv = await open_rendezvous(self.config.store_host, self.config.port_range, self.port_owner())
        except RendezvousError as exc:
            return Outcome(AttemptEnd.FAILED, "rendezvous", RootCause(reason="rendezvous", detail=str(exc)))
        job.store_port = rdzv.port
        lay = self.layout
        nodes: dict[str, Any] = {} if lay is None else {"node_rank": lay.node_rank, "nnodes": lay.nnodes,
                                                        "world_size": lay.world_size}
        await self.journal.event(job, "job.rendezvous", host=rdzv.host, port=rdzv.port, **nodes)
        self._logs = LogKeeper(self.journal, job, self.number)  # watches the ranks' logs as they start
        try:
            await self._report_fences(rdzv)
            async with anyio.create_task_group() as tg:
                self._tg = tg
                try:
                    tg.start_soon(self._logs.run)
                    await self._launch(tg, rdzv)
                    tg.start_soon(self._timers)
                    tg.start_soon(self._release_store_host, rdzv)
                    if self.nodes is not None:
                        tg.start_soon(watch_nodes, self.nodes, self)
                    await self._concluded.wait()
                finally:
                    with anyio.CancelScope(shield=True):
                        if self.outcome is None:  # cancelled from outside: the daemon is stopping
                            self.conclude(Outcome(AttemptEnd.DAEMON_STOPPING, "daemon_shutdown", graceful=True))
                        await self._teardown()
                        tg.cancel_scope.cancel()
        finally:
            for h in self.handles:
                h.channel.close()
                if h.logs is not None:
                    h.logs.close()
            self._logs.close()
            with anyio.CancelScope(shield=True):
                await close_rendezvous(rdzv)
        assert self.outcome is not None
        outcome = self._finish_outcome(self.outcome)
        if self.nodes is not None:
            with anyio.CancelScope(shield=True):
                outcome = await settle(self.nodes, outcome, self.number, self.clock)
        return outcome

    def _finish_outcome(self, outcome: Outcome) -> Outcome:
        stopped = any(h.result is not None and h.result.stopped_early for h in self.handles)
        outcome = settle_stop(outcome, None if stopped else self.exit_outcome(), self.job.spec.script is not None)
        if outcome.end is AttemptEnd.FAILED and outcome.root_cause is None:
            outcome.root_cause = pick_root_cause(self._evidence(), self.number, outcome.reason)
        if outcome.hang and outcome.root_cause is not None:
            outcome.root_cause = explain_hang(outcome.root_cause, self.gang.stack_sites,
                                              {h.rank.rank: h.rank.step for h in self.handles})
        if outcome.root_cause is not None:
            outcome.root_cause = outcome.root_cause.clipped()
        return outcome

    def _evidence(self) -> list[Evidence]:
        return [  # ranks replaced in place too: a re-form that failed has the lost rank as its cause
            Evidence(rank=h.rank.rank, state=h.state_at_failure or h.rank.state.value, exit=h.exit,
                     failure=h.failure, failed_at=h.failed_at, signals_sent_before_exit=h.signals_before_exit)
            for h in [*self.replacements.lost, *self.handles]
        ]

    # -- launching -------------------------------------------------------------------------

    async def _launch(self, tg: anyio.abc.TaskGroup, rdzv: Rendezvous) -> None:
        job = self.job
        assert self.identity is not None
        try:
            await anyio.to_thread.run_sync(prepare_dirs, self.config.state_dir, self.identity, job.id, self.number)
        except OSError as exc:
            self.conclude(Outcome(AttemptEnd.FAILED, "spawn_failed", RootCause(
                reason="spawn_failed", attempt=self.number, detail=clip_text(f"cannot prepare the attempt: {exc}"))))
            return
        cgroup = await self._create_cgroup()
        if wanted(job.spec):  # --mem / --cpus: applied where the controller is delegated, else said why not
            try:
                limits = await anyio.to_thread.run_sync(apply_limits, job.spec, self.gang.cgroup, self.subtree)
            except (OSError, ValueError) as exc:
                limits = LimitsOutcome(unavailable={c: f"cannot write the limit: {exc}" for c in wanted(job.spec)})
            await self.journal.event(job, "job.limits", applied=limits.applied, unavailable=limits.unavailable)
        launcher = self._launcher = self._launcher_for(rdzv)
        launcher.use_pool()
        self.replacements.store_host_rank = self.offset if rdzv.hosted else None
        # the row, its marker and its cgroup first: a daemon killed mid-spawn finds this attempt's processes
        await self.journal.save_attempt(job, self.number, pgid=None, store_port=launcher.rdzv.port,
                                        token=self.token, cgroup=cgroup)
        for local in range(job.spec.nproc):
            if self.outcome is not None:
                return
            h = await self._start_rank(tg, local)
            if h is None:
                return
            if h is self.handles[0]:
                await self.journal.save_attempt(job, self.number, pgid=self.gang.pgid, store_port=launcher.rdzv.port,
                                                token=self.token, cgroup=cgroup)

    async def _start_rank(self, tg: anyio.abc.TaskGroup, local: int,
                          lost: RankHandle | None = None) -> RankHandle | None:
        """Start local rank `local` (or the replacement of `lost`: its log appended after a marker line,
        its place in the gang and the job's ranks taken over); None when it cannot start (concluded)."""
        job, launcher = self.job, self._launcher
        assert self.identity is not None and launcher is not None
        r = self.offset + local
        log_path = self.dir / rank_log_name(r)
        try:
            fds = await anyio.to_thread.run_sync(create_logs, self.config.state_dir, self.identity, job.id,
                                                 self.number, r)
            try:
                if lost is not None:
                    marker = (f"ddpd: rank {r} (pid {lost.proc.pid}) was lost; its replacement (generation "
                              f"{launcher.generations.get(local, 0)}) writes from here\n").encode()
                    # the job's own files: written off the event loop, as every rank log is
                    await anyio.to_thread.run_sync(_write_each, fds, marker)
                    logs = lost.logs
                    lost.logs = None
                else:
                    logs = await anyio.to_thread.run_sync(
                        live_streams, self.config.state_dir, self.identity, job, self.number,
                        [str(log_path), stderr_log(str(log_path))], list(fds))
                try:
                    h = await launcher.start(local, log_path, fds)
                except BaseException:
                    if logs is not None:
                        logs.close()
                    raise
                h.logs = logs
            finally:
                for fd in fds:
                    os.close(fd)
        except OSError as exc:
            self.conclude(Outcome(AttemptEnd.FAILED, "spawn_failed", RootCause(
                reason="spawn_failed", rank=r, attempt=self.number,
                detail=clip_text(f"cannot start rank {r}: {exc}"))))
            return None
        if lost is None:
            self.gang.add(h)
            job.ranks.append(h.rank)
        else:
            h.rank.replacements = lost.rank.replacements + 1
            self.gang.take_over(lost, h)
            job.ranks[job.ranks.index(lost.rank)] = h.rank
        await self.journal.save_rank(job, h.rank)
        told: dict[str, Any] = {"pooled": True} if h.pooled else {}
        if lost is not None:
            told["replaces"] = lost.proc.pid
        await self.journal.event(job, "rank.spawned", rank=r, pid=h.proc.pid, pgid=h.rank.pgid,
                                 log=str(log_path), **told)
        tg.start_soon(self._rank_tasks, h)
        return h

    async def _create_cgroup(self) -> str | None:
        """The attempt's cgroup under the daemon's subtree (its path), or None: without one, the ranks
        are contained by their process group and marker alone (logged as `cgroup.attempt_failed`)."""
        if self.subtree is None:
            return None
        try:
            cg = await anyio.to_thread.run_sync(AttemptCgroup.create, self.subtree.jobs,
                                                f"{self.job.id}-a{self.number}")
        except OSError as exc:
            self.log.warning("cgroup.attempt_failed", error=str(exc))
            return None
        self.gang.contain_in(cg)
        return str(cg.path)

    def _launcher_for(self, rdzv: Rendezvous) -> Launcher:
        """The attempt's launcher, once its cgroup (where there is one) exists."""
        assert self.identity is not None
        job = self.job
        return Launcher(LaunchContext(
            config=self.config, job=job, number=self.number, marker=self.marker, rdzv=rdzv, identity=self.identity,
            run_as=self.run_as(), attempt_dir=self.dir, job_dir=self.job_dir, checkpoint_dir=self.checkpoint_dir,
            join_timeout=self.limits.join, clock=self.clock, cgroup=self.gang.cgroup, layout=self.layout,
            defaults=rank_defaults(self.timeouts, self.dir, gpus=bool(job.gpus),
                                   hot_replace=hot_replacements(job.spec) > 0)), self.pool)

    async def _rank_tasks(self, h: RankHandle) -> None:
        """The rank's reader and exit watcher, bound to its job, attempt and rank in the logs."""
        with bound_contextvars(job_id=self.job.id, attempt=self.number, rank=h.rank.rank):
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(watch_exit, h, self)
                    log_max = min(self.job.spec.log_max or self.config.rank_log_max, self.config.rank_log_max)
                    tg.start_soon(keep_logs, h, self._logs, log_max)
                    if h.hello is not None:  # a pooled rank said hello to the pool
                        await self.connected(h, h.hello)
                    await read_frames(h, self)
            finally:
                h.tasks_done.set()

    # -- hot replacement (replace.py) --------------------------------------------------------

    def lost(self, h: RankHandle) -> str | None:
        """A rank died: None when it is replaced in place (reserved now), else why not."""
        why = self.replacements.refusal(h, concluded=self.outcome is not None or self._tg is None,
                                        signalled=bool(self.gang.signals_sent))
        if why is None:
            self.replacements.begin(h, self.clock.monotonic())
        return why

    def replace(self, h: RankHandle) -> None:
        r = self.replacements.under_way
        assert self._tg is not None and r is not None and r.lost is h
        self._tg.start_soon(reform, self, self.replacements, r)

    async def reformed(self, h: RankHandle, generation: int) -> None:
        self.replacements.on_reformed(h, self.clock.monotonic(), self.job.spec.nproc, generation)

    def live(self) -> list[RankHandle]:
        return self.gang.live()

    def generation_of(self, local: int, generation: int) -> None:
        assert self._launcher is not None
        self._launcher.generations[local] = generation

    async def start_replacement(self, local: int, lost: RankHandle) -> RankHandle | None:
        assert self._tg is not None
        return await self._start_rank(self._tg, local, lost)

    async def connected(self, h: RankHandle, hello: Hello) -> None:
        """The rank said hello (to the attempt, or earlier to the pool): record it, send the assignment.

        Every rank, pooled or cold, leads a session and a process group of its own (Assign.pgid 0:
        a pooled one stays where the pool started it), checked against /proc when a pooled one
        reports store_connected.
        """
        await self.journal.rank_state(self.job, h.rank, RankState.CONNECTED, "rank.connected",
                                      worker_pid=hello.pid, protocol=hello.version, torch=hello.torch,
                                      pooled=h.pooled)
        assert self._launcher is not None
        await hand_over(self._launcher.rdzv, h.channel, self._launcher.assignment(h))
        self.replacements.connected(h, self.clock.monotonic())

    def port_owner(self) -> PortOwner:
        """Who may connect to this attempt's ports from this host (portfence): its owner, and root. A
        multi-node job's ports must be fenced, unless the operator allows them unfenced."""
        required = self.nodes is not None and not self.config.allow_unfenced
        return PortOwner(self.job.owner_uid, daemon_tag(self.config.state_dir), f"{self.job.id}/a{self.number}",
                         required)

    async def _report_fences(self, rdzv: Rendezvous) -> None:
        """A port that could not be fenced (no nft, no permission) is said in the job's events."""
        unfenced = [(rdzv.port, rdzv.unfenced)] if rdzv.unfenced else []
        if self.nodes is not None and self.nodes.unfenced:  # the endpoint's port, where this daemon serves it
            unfenced.append((self.nodes.port, self.nodes.unfenced))
            self.nodes.unfenced = ""
        for port, why in unfenced:
            await self.journal.event(self.job, "job.port_unfenced", port=port, reason=clip_text(why))

    async def _release_store_host(self, rdzv: Rendezvous) -> None:
        """Local rank 0 serves the store after its own result until every other local rank has exited."""
        if not rdzv.hosted or not self.handles or len(self.handles) != self.job.spec.nproc:
            return
        while waiting := [h for h in self.handles[1:] if not h.exited.is_set()]:  # replacements included
            await waiting[0].exited.wait()
        await self.handles[0].channel.send(Release())

    async def check_pgid(self, h: RankHandle) -> None:
        """A pooled rank still leads its own process group (the one the gang signals): verify it."""
        info = await anyio.to_thread.run_sync(procs.proc_info, h.proc.pid)
        if info is not None and h.proc.returncode is None and info.pgid != h.rank.pgid:
            raise FrameError("pgid_mismatch", f"rank {h.rank.rank} (pid {h.proc.pid}) is in process group "
                                              f"{info.pgid}, not its own {h.rank.pgid}")

    # -- deadlines -------------------------------------------------------------------------

    def _watch(self) -> Watch:
        wall_at = None
        if self.limits.wall is not None and self.job.started_at is not None:  # counted from the first start
            wall_at = self._started + self.limits.wall - (self._started_wall - self.job.started_at)
        return Watch(number=self.number, started=self._started, nproc=self.job.spec.nproc,
                     script=self.job.spec.script is not None, wall_at=wall_at, warned=self._warned)

    async def _timers(self) -> None:
        while self.outcome is None:
            self._replan = anyio.Event()
            now = self.clock.monotonic()
            watch = self._watch()
            verdict = check(self.limits, watch, [h.clock_view() for h in self.handles], now)
            if verdict.outcome is not None:
                self.conclude(verdict.outcome)
                return
            for h in self.handles:
                if h.rank.rank in verdict.missed:
                    h.missed_reported = h.rank.last_frame
                    await self.journal.event(self.job, "rank.heartbeat_missed", rank=h.rank.rank,
                                             silent=round(now - (h.rank.last_frame or now), 3),
                                             interval=self.config.heartbeat_interval,
                                             timeout=self.limits.heartbeat, state=h.rank.state.value)
            if verdict.stuck:
                await self._end_stuck([h for h in self.handles if h.rank.rank in verdict.stuck], now)
                continue
            if verdict.warn:
                await self._warn_stop(now, watch.wall_at or now)
                continue
            # sleep until the earliest deadline (re-checked then: a heartbeat may have moved it later),
            # or until a frame starts a new deadline that may come sooner (bug: a 4 s progress timeout
            # used to wait for the 120 s join deadline the timer had gone to sleep on). Not sooner than
            # TIMER_GRAIN: every heartbeat moves its rank's deadlines, so the earliest one comes due
            # (and has moved) ranks times a second; each wake checks every rank (ranks squared a second)
            wake = max(now + TIMER_GRAIN, verdict.next_at if verdict.next_at is not None else now + 1.0)
            await wait_until(self.clock, wake, self._replan.wait)

    async def _end_stuck(self, stuck: list[RankHandle], now: float) -> None:
        """Ranks that sent their result and then fell silent in their exit work (a native call holding
        the GIL): where each is (its stacks), then it alone is killed; its result stands."""
        for h in stuck:
            h.ended_at_exit = True
        await self.gang.dump_stacks(only=stuck)
        for h in stuck:
            site = self.gang.stack_sites.get(h.rank.rank)
            silent = now - (h.rank.last_frame or now)
            where = f" in {site.innermost}" if site is not None else ""
            await self.journal.event(
                self.job, "rank.stuck_at_exit", rank=h.rank.rank, seconds=round(silent, 1),
                where=site.describe() if site is not None else None,
                message=f"rank {h.rank.rank} finished its {'script' if self.job.spec.script else 'task'} and "
                        f"was stuck at exit{where} for {silent:.0f} s; ended (its result is kept)")
            if h.proc.returncode is None and h.rank.pgid is not None:
                procs.kill_group(h.rank.pgid, signal.SIGKILL)

    async def _warn_stop(self, now: float, wall_at: float) -> None:
        """Before the wall-time limit (as Slurm's --signal): every rank is asked to stop at a step
        boundary and checkpoint. Ranks that then exit 0 end the job TIMED_OUT (wall_time) at once;
        ranks that do not stop are torn down when the wall time runs out."""
        self._warned = True
        for h in self.gang.live():
            await h.channel.send(Stop(reason="wall_time_warning"))
        await self.journal.event(self.job, "job.stop_warning", reason="wall_time_warning",
                                 seconds_left=round(wall_at - now, 3), wall=self.limits.wall)

    # -- on demand -----------------------------------------------------------------------

    async def stacks(self, rank: int | None, native: bool) -> StacksResult:
        """The current stacks of this attempt's ranks (or of `rank`), asked on their channels; the job
        runs on."""
        py_spy = await anyio.to_thread.run_sync(find_py_spy)
        return await collect(self.job.id, self.number, self.handles, rank=rank, native=native, py_spy=py_spy)

    # -- teardown --------------------------------------------------------------------------

    async def _teardown(self) -> None:
        assert self.outcome is not None
        outcome = self.outcome
        self.gang.reason = outcome.reason
        t0 = self.clock.monotonic()
        await escalate(self.gang, self.clock, self.timeouts.kill_grace,
                       graceful=outcome.graceful, hang=outcome.hang)
        await self.journal.event(self.job, "job.torn_down", seconds=round(self.clock.monotonic() - t0, 3),
                                 reason=outcome.reason)
