"""One attempt of one job: rendezvous, launch, watch every rank, decide, tear down.

The attempt's story, told by the modules it composes: `rendezvous` binds the store's port before
any rank starts; the attempt row and its marker are saved (journal) before the first rank is
spawned; `start` starts each rank (`launch`: cold or from the warm pool, with an environment
built once) and runs its tasks; `ranks` turns each rank's frames and exit into its state. Every
task reports upward on one stream (`events`) and the attempt's one loop (`loop.Supervisor`)
decides: `deadlines` says when a timeout is due, `decide` what a rank's exit means, `replace`
whether a lost rank is replaced in place; the first conclusion wins (the rest is collateral);
`teardown` escalates against one deadline over the attempt's `gang`, shielded, and ends only when
no process of the attempt is left.

Commands from outside (a cancel, a GPU fault, a preemption, the daemon stopping) conclude the
attempt at once, before or while it runs, and wake its loop (`Stopped`).

A multi-node attempt (`nodes`, the job's `NodeSession`) forms through torch's elastic rendezvous
instead of binding its own store (unless it is node rank 0), starts this node's ranks at their
global ranks (`layout`), runs the node watch beside its ranks (`multinode.watch_nodes`), and after
the teardown settles the root cause with the other nodes (`multinode.settle`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import signal
import time
from typing import Any

import anyio
import anyio.to_thread
import structlog

from ...protocol.control import RootCause, StacksResult
from ...protocol.limits import clip_text
from ...protocol.spec import hot_replacements
from ...protocol.timeouts import Timeouts, need
from ...protocol.worker import attempt_marker, marker_entry
from ..config import Config
from ..contain.cgroups import Cgroup, Subtree
from ..contain.identity import Identity, UnknownUser
from ..contain.joblimits import LimitsOutcome, apply_limits, wanted
from ..contain.portfence import PortOwner, daemon_tag
from ..contain.usertree import open_user_file
from ..gpu.rankenv import rank_defaults
from ..layout import checkpoint_dir, user_attempt_dir, user_job_dir
from ..multinode.agentproc import agent_launch
from ..multinode.multinode import settle
from ..multinode.nodes import NodeLayout, NodeSession
from ..pool.pool import WarmPool
from ..ranklogs.keeper import LogKeeper
from ..ranklogs.workspace import prepare_dirs
from ..run.clock import Clock, RealClock
from ..run.outcome import AttemptEnd, Outcome, settle_stop
from ..run.rendezvous import Rendezvous, RendezvousError, close_rendezvous, open_rendezvous
from ..run.rootcause import Evidence, explain_hang, pick_root_cause
from ..store.journal import Journal
from ..store.records import Job
from .deadlines import Limits
from .events import Events, Launched, Stopped, open_events
from .gang import RankGang
from .launch import LaunchContext, Launcher
from .loop import Supervisor
from .ranks import RankHandle, RankLink
from .stacks import collect, find_py_spy
from .start import Starter

log = structlog.get_logger("ddpd")

__all__ = ["Attempt", "Outcome"]


def boot_ticks() -> int:
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * os.sysconf("SC_CLK_TCK"))


class Attempt:
    def __init__(self, config: Config, journal: Journal, job: Job, number: int, timeouts: Timeouts,
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
        self.token = secrets.token_hex(8)
        self.marker = attempt_marker(job.id, number, self.token)
        self.gang = RankGang(job, journal, self.clock, marker_entry(job.id, number, self.token), boot_ticks(),
                             opener=functools.partial(open_user_file, config.state_dir, job.owner_uid))
        if job.spec.script is not None and config.stop_signal != "none":  # built-in tasks stop by the API alone
            self.gang.stop_signal = signal.Signals[config.stop_signal].value
        self.limits = Limits(join=need(timeouts.join), heartbeat=need(timeouts.heartbeat),
                             progress=need(timeouts.progress), heartbeat_interval=config.heartbeat_interval,
                             wall=timeouts.wall, stop_warning=need(timeouts.stop_warning),
                             failed_exit=need(timeouts.kill_grace))
        self.supervisor = Supervisor(job, journal, number, self.clock, self.limits, self.gang,
                                     heartbeat_interval=config.heartbeat_interval, kill_grace=need(timeouts.kill_grace),
                                     nodes=nodes)
        self._events: Events | None = None  # the send side of the attempt's stream, while it runs
        self._starter: Starter | None = None
        # the owner's tree (usertree, layout): <state_dir>/users/<uid>/jobs/<job>/{attempt-<n>,checkpoints}
        self.job_dir = user_job_dir(config.state_dir, job.owner_uid, job.id)
        self.dir = user_attempt_dir(config.state_dir, job.owner_uid, job.id, number)
        self.checkpoint_dir = checkpoint_dir(config.state_dir, job.owner_uid, job.id)
        self.identity: Identity | None = None
        self.log = log.bind(job_id=job.id, attempt=number)

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

    @property
    def outcome(self) -> Outcome | None:
        """How the attempt ends, once concluded (the first conclusion)."""
        return self.supervisor.outcome

    # -- commands from outside ---------------------------------------------------------------

    def conclude(self, outcome: Outcome) -> None:
        """End the attempt so (a preemption, say): the first conclusion wins; its loop is woken."""
        self.supervisor.conclude(outcome)
        if self._events is not None:  # its loop runs: wake it (before, the loop finds the conclusion at its start)
            with contextlib.suppress(anyio.ClosedResourceError):
                self._events.send_nowait(Stopped())

    def signals_sent(self) -> frozenset[str]:
        return frozenset(self.gang.signals_sent)

    def reported_failure(self) -> bool:
        """Whether a rank of this attempt has sent its failure (it may not have exited yet)."""
        return any(h.failure is not None for h in self.handles)

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
        logs = LogKeeper(self.journal, job, self.number)  # watches the ranks' logs as they start
        try:
            await self._report_fences(rdzv)
            await self._supervise(rdzv, logs)
        finally:
            for h in self.handles:
                h.channel.close()
                if h.logs is not None:
                    h.logs.close()
            logs.close()
            with anyio.CancelScope(shield=True):
                await close_rendezvous(rdzv)
        assert self.outcome is not None
        outcome = self._finish_outcome(self.outcome)
        if self.nodes is not None:
            with anyio.CancelScope(shield=True):
                outcome = await settle(self.nodes, outcome, self.number, self.clock)
        return outcome

    async def _supervise(self, rdzv: Rendezvous, logs: LogKeeper) -> None:
        """The attempt's task group: its log keeper, its launch (every rank's tasks run in it) and its loop."""
        sup = self.supervisor
        send, receive = open_events()
        with send, receive:
            self._events = send
            try:
                async with anyio.create_task_group() as tg:
                    try:
                        tg.start_soon(logs.run)
                        starter = self._starter = await self._prepare(rdzv, logs, send)
                        if starter is not None:
                            tg.start_soon(starter.launch)
                        else:
                            send.send_nowait(Launched())
                        await sup.run(tg, send, receive, starter)
                    finally:
                        with anyio.CancelScope(shield=True):
                            if not sup.torn_down:  # cancelled from outside: the daemon is stopping
                                sup.conclude(Outcome(AttemptEnd.DAEMON_STOPPING, "daemon_shutdown", graceful=True))
                                await sup.teardown(self._starter)
                            tg.cancel_scope.cancel()
            finally:
                self._events = None

    def _finish_outcome(self, outcome: Outcome) -> Outcome:
        stopped = any(h.result is not None and h.result.stopped_early for h in self.handles)
        outcome = settle_stop(outcome, None if stopped else self.supervisor.exit_outcome(),
                              self.job.spec.script is not None)
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
            for h in [*self.supervisor.replacements.lost, *self.handles]
        ]

    # -- before the first rank ---------------------------------------------------------------

    async def _prepare(self, rdzv: Rendezvous, logs: LogKeeper, events: Events) -> Starter | None:
        """The attempt's directories, cgroup, limits, launcher and row (with its marker and cgroup,
        before any rank: a daemon killed mid-spawn finds this attempt's processes); None when the
        directories cannot be made (the attempt concluded so)."""
        job = self.job
        assert self.identity is not None
        try:
            await anyio.to_thread.run_sync(prepare_dirs, self.config.state_dir, self.identity, job.id, self.number)
        except OSError as exc:
            self.supervisor.conclude(Outcome(AttemptEnd.FAILED, "spawn_failed", RootCause(
                reason="spawn_failed", attempt=self.number, detail=clip_text(f"cannot prepare the attempt: {exc}"))))
            return None
        cgroup = await self._create_cgroup()
        if wanted(job.spec):  # --mem / --cpus: applied where the controller is delegated, else said why not
            try:
                limits = await anyio.to_thread.run_sync(apply_limits, job.spec, self.gang.cgroup, self.subtree)
            except (OSError, ValueError) as exc:
                limits = LimitsOutcome(unavailable={c: f"cannot write the limit: {exc}" for c in wanted(job.spec)})
            await self.journal.event(job, "job.limits", applied=limits.applied, unavailable=limits.unavailable)
        launcher = self._launcher_for(rdzv)
        launcher.use_pool()
        self.supervisor.replacements.store_host_rank = self.offset if rdzv.hosted else None
        await self.journal.save_attempt(job, self.number, pgid=None, store_port=launcher.rdzv.port,
                                        token=self.token, cgroup=cgroup)
        link = RankLink(job=job, journal=self.journal, number=self.number, clock=self.clock,
                        frame_rate=float(self.config.rank_frames_per_second), events=events,
                        signals=self.gang.signals_sent, rdzv=rdzv, assignment=launcher.assignment)
        return Starter(config=self.config, journal=self.journal, job=job, number=self.number,
                       identity=self.identity, attempt_dir=self.dir, launcher=launcher, gang=self.gang, logs=logs,
                       link=link, concluded=self.supervisor.concluded, token=self.token, cgroup=cgroup)

    async def _create_cgroup(self) -> str | None:
        """The attempt's cgroup under the daemon's subtree (its path), or None: without one, the ranks
        are contained by their process group and marker alone (logged as `cgroup.attempt_failed`)."""
        if self.subtree is None:
            return None
        try:
            cg = await anyio.to_thread.run_sync(Cgroup.create, self.subtree.jobs,
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

    # -- on demand -----------------------------------------------------------------------

    async def stacks(self, rank: int | None, native: bool) -> StacksResult:
        """The current stacks of this attempt's ranks (or of `rank`), asked on their channels; the job
        runs on."""
        py_spy = await anyio.to_thread.run_sync(find_py_spy)
        return await collect(self.job.id, self.number, self.handles, rank=rank, native=native, py_spy=py_spy)
