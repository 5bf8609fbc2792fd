"""Notifications: when a job ends, restarts or is preempted, its hooks are run as its submitter.

A job's hooks are its spec's `notify` (a shell command) and `notify_url` (a URL), then the
daemon's own (config `notify`, `notify_url`). Each runs as the job's owner, never in the root
daemon: the command through ``/bin/sh -c`` with the job's facts in ``DDPD_JOB_*`` variables; a
URL by a small stdlib program of the daemon's interpreter (``-I -S``), run as that user, that
POSTs the same facts as JSON (so a URL reaches only what its submitter could reach: the port
fences let root through, never this). Where the daemon has a cgroup subtree, each run is in a
cgroup of its own (``notify-<uid>-<n>``), entered before the user's code runs (the gate) and
killed and removed afterwards, so nothing it started outlives it; a killed daemon's are swept at
the next start. A hook is a helper process (`HOOKS`, run as `ddpd.daemon.contain.helpers` runs
them all).

Never blocking the daemon: the scheduler only `post`s a notice (a bounded queue; a full one drops
it, journalled); `run` delivers them in tasks of its own, at most `AT_ONCE` at a time, each run
bounded by `notify_timeout` seconds (then its group and cgroup are killed) and retried once. A hook
that fails twice is a ``job.notify_failed`` event; one that worked, ``job.notified``; a first failure,
``job.notify_retrying``. Each says how the run ended: the hook's real exit status (``exit_code``, or
``signal``) and, for a URL, the HTTP status of the answer (``http_status``; none where none came).

Bug (issue 34, finding 9): a hook's child was not registered with the reaper of inherited children
(it leads a process group of its own, so the reaper took it for an orphan): the reaper reaped it
first, `wait()` got ECHILD, CPython reported exit status 0, and a hook that exited 3, or a URL on a
closed port, was recorded as delivered and never retried. Every hook now starts through
`reaper.spawned`, so only its own `wait()` reaps it.

The curve picture: where the plot extra (matplotlib) is installed, a job's end is first drawn as the
submitter, by `ddpctl plot JOB --png` of the job's interpreter and environment (those its ranks ran
with) through the daemon's socket (in a cgroup of its own, bounded like a hook), into the job's
folder (``<state>/users/<uid>/jobs/<job>/curve.png``, the submitter's); the hooks are then told its
path (``DDPD_JOB_CURVE``, ``curve`` in the JSON; empty where there is no picture: no extra, no
points, or the drawing failed).
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

import anyio
import anyio.abc
import anyio.to_thread
import structlog

from ...protocol.spec import reserved_env
from ..config import Config
from ..contain.cgroups import Subtree
from ..contain.helpers import HelperKind, Place, run_bounded, run_contained
from ..contain.identity import SANE_PATH, Identity, UnknownUser, job_environment, submitted_environment
from ..contain.procs import Exit
from ..layout import user_job_dir
from ..store.journal import Journal
from ..store.records import Job
from .live import LiveConfig

log = structlog.get_logger("ddpd")

HOOKS = HelperKind("notify", prefix="notify-", kill_wait=10.0)  # a hook's cgroup: ``notify-<uid>-<n>``
QUEUED_AT_MOST = 256  # notices waiting for delivery
AT_ONCE = 4  # hooks running at once, all users together
RETRY_PAUSE = 1.0  # seconds before the one retry
ERROR_TAIL = 400  # bytes of a failed hook's stderr kept in its event
PICTURE = "curve.png"  # the curve picture, in the job's folder

Event = Literal["ended", "restarting", "preempted"]

# run as the submitter by the daemon's interpreter (-I -S: no site, no user paths): POST the JSON
# of DDPD_NOTIFY_JSON to argv[1] within argv[2] seconds; the answer's HTTP status on stdout; exit 0
# on a 2xx answer
POSTER = """
import os, sys, urllib.error, urllib.request
req = urllib.request.Request(sys.argv[1], data=os.environ["DDPD_NOTIFY_JSON"].encode(), method="POST",
                             headers={"Content-Type": "application/json", "User-Agent": "ddpd-notify"})
try:
    with urllib.request.urlopen(req, timeout=float(sys.argv[2])) as answer:
        code = answer.status
except urllib.error.HTTPError as exc:
    code = exc.code
except Exception as exc:
    sys.exit(f"POST {sys.argv[1]}: {exc}")
print(code, flush=True)
sys.exit(0 if 200 <= code < 300 else f"POST {sys.argv[1]}: HTTP {code}")
"""
STATUS_BYTES = 16  # of the poster's stdout: its HTTP status (a user's process: read bounded, typed)


@dataclass(frozen=True)
class Notice:
    """What a hook is told of a job (its environment as DDPD_JOB_*, or the JSON body)."""

    id: str
    name: str
    event: Event
    state: str
    reason: str | None
    root_cause: str | None
    attempt: int
    duration: float | None
    last_loss: float | None
    owner_uid: int
    curve: str | None = None  # the path of the job's curve picture, where one was drawn


def notice_of(job: Job, event: Event, now: float) -> Notice:
    rc = job.root_cause
    cause = None if rc is None else (rc.detail or rc.message or rc.error or rc.reason)
    losses = [r.loss for r in sorted(job.ranks, key=lambda r: r.rank) if r.loss is not None]
    duration = None if job.started_at is None else round((job.finished_at or now) - job.started_at, 3)
    return Notice(id=job.id, name=job.name, event=event, state=job.state.value, reason=job.reason, root_cause=cause,
                  attempt=job.attempt, duration=duration, last_loss=losses[0] if losses else None,
                  owner_uid=job.owner_uid)


def variables(notice: Notice) -> dict[str, str]:
    """DDPD_JOB_ID, DDPD_JOB_STATE, ... ("" for what is not known)."""
    return {f"DDPD_JOB_{key.upper()}": "" if value is None else str(value) for key, value in asdict(notice).items()
            if key != "owner_uid"}


@dataclass(frozen=True)
class HookRun:
    """How one run of a hook ended: why it failed (None: it worked), its exit status as its own
    `wait()` saw it (None: it never started, or was cut off at its bound) and, for a URL, the HTTP
    status of the answer (None: no answer)."""

    error: str | None
    exit: Exit | None = None
    http_status: int | None = None

    def facts(self) -> dict[str, Any]:
        """The event's fields of this run: `exit_code` or `signal`, and `http_status`."""
        out: dict[str, Any] = {}
        if self.exit is not None:
            out.update({"exit_code": self.exit.code} if self.exit.signal is None else {"signal": self.exit.signal})
        if self.http_status is not None:
            out["http_status"] = self.http_status
        return out


@dataclass(frozen=True)
class Hook:
    kind: Literal["command", "url"]
    target: str

    def argv(self, timeout: float) -> list[str]:
        if self.kind == "command":
            return ["/bin/sh", "-c", self.target]
        return [sys.executable, "-I", "-S", "-c", POSTER, self.target, f"{max(1.0, timeout - 1):g}"]


def hooks_of(job: Job, cfg: Config) -> list[Hook]:
    found = [Hook("command", job.spec.notify) if job.spec.notify else None,
             Hook("url", job.spec.notify_url) if job.spec.notify_url else None,
             Hook("command", cfg.notify) if cfg.notify else None,
             Hook("url", cfg.notify_url) if cfg.notify_url else None]
    return [h for h in found if h is not None]


def http_status(said: bytes) -> int | None:
    """The HTTP status the poster printed (a user's process: anything but 100-599 is none)."""
    text = said.strip()
    return int(text) if text.isdigit() and len(text) == 3 and 100 <= int(text) <= 599 else None


def run_hook(argv: list[str], env: dict[str, str], identity: Identity, timeout: float,
             place: Place | None, *, answer: bool = False) -> HookRun:
    """Run one hook as `identity` for at most `timeout` seconds (blocking): how it ended. `answer`:
    its stdout is a URL hook's HTTP status (else /dev/null).

    A helper process (`helpers.run_bounded`), started through `reaper.spawned`: the reaper of
    inherited children never reaps it, so the exit status is the hook's own (see the module's bug)."""
    try:
        ran = run_bounded(argv, env, identity, timeout, place, what="the notification hook",
                          stdout_keep=STATUS_BYTES if answer else 0, stderr_keep=ERROR_TAIL)
    except OSError as exc:
        return HookRun(f"cannot start it: {exc.strerror or exc}")
    said = ran.stderr.decode(errors="replace").strip()
    status = http_status(ran.stdout) if answer else None
    if ran.returncode is None:
        return HookRun(f"did not finish within {timeout:g} s", http_status=status)
    ended = Exit.from_returncode(ran.returncode)
    if ended.ok:
        return HookRun(None, ended, status)
    why = f"exit status {ran.returncode}" if ended.signal is None else f"killed by {ended.signal}"
    return HookRun(why + (f": {said.splitlines()[-1]}" if said else ""), ended, status)


def picture_argv(python: str, socket: Path, job_id: str, path: Path) -> list[str]:
    """`ddpctl plot JOB --png PATH` of the job's own interpreter, run as the submitter."""
    return [python, "-m", "ddpd.cli", "plot", job_id, "--png", str(path), "--socket", str(socket)]


def can_draw() -> bool:
    """Whether the plot extra is installed (looked up, not imported: the daemon never loads it)."""
    return importlib.util.find_spec("matplotlib") is not None


class JobHooks:
    """A job's hooks: `post` a job's notice (never blocks); `run` delivers the notices until cancelled."""

    def __init__(self, live: LiveConfig, journal: Journal, subtree: Subtree | None) -> None:
        self.live = live  # the daemon's current config (read at each use: a reload changes the hooks)
        self.journal = journal
        self.subtree = subtree
        self._send, self._receive = anyio.create_memory_object_stream[tuple[Job, Notice, list[Hook]]](QUEUED_AT_MOST)
        self._serial = itertools.count(1)
        self._threads = anyio.CapacityLimiter(AT_ONCE)
        self._draws = can_draw()

    def post(self, job: Job, event: Event) -> None:
        hooks = hooks_of(job, self.live.current)
        if not hooks:
            return
        try:
            self._send.send_nowait((job, notice_of(job, event, time.time()), hooks))
        except anyio.WouldBlock:
            log.warning("notify.dropped", job_id=job.id, event=event, waiting=QUEUED_AT_MOST)

    async def run(self) -> None:
        if self.subtree is not None:
            await anyio.to_thread.run_sync(HOOKS.sweep, self.subtree.jobs)
        async with anyio.create_task_group() as tg:
            async for job, notice, hooks in self._receive:
                tg.start_soon(self._deliver_all, job, notice, hooks)

    async def _deliver_all(self, job: Job, notice: Notice, hooks: list[Hook]) -> None:
        """The curve picture of an ended job first (where it can be drawn), then every hook at once."""
        if notice.event == "ended" and self._draws:
            with structlog.contextvars.bound_contextvars(job_id=job.id, attempt=notice.attempt):
                try:
                    notice = replace(notice, curve=await self._draw(job))
                except Exception:  # a bug in the drawing must not cost the hooks
                    log.exception("notify.internal_error", hook="curve")
        async with anyio.create_task_group() as tg:
            for hook in hooks:
                tg.start_soon(self._deliver, job, notice, hook)

    async def _draw(self, job: Job) -> str | None:
        """Draw the job's curve into its folder as its submitter; the picture's path, or None."""
        try:
            identity = await anyio.to_thread.run_sync(Identity.of, job.owner_uid)
        except UnknownUser:
            return None
        cfg = self.live.current
        path = user_job_dir(cfg.state_dir, job.owner_uid, job.id) / PICTURE
        python = job.spec.python or sys.executable  # what the job ran with (checked at its submit)
        exported = {k: v for k, v in submitted_environment(identity, job.spec.environ).items() if not reserved_env(k)}
        env = job_environment(identity, exported, job.spec.env, {})
        drawn = await self._once(identity, picture_argv(python, cfg.socket, job.id, path), env)
        if drawn.error is not None:
            log.info("notify.no_curve", error=drawn.error, **drawn.facts())
            return None
        return str(path)

    async def _deliver(self, job: Job, notice: Notice, hook: Hook) -> None:
        with structlog.contextvars.bound_contextvars(job_id=job.id, attempt=notice.attempt):
            try:
                await self._deliver_hook(job, notice, hook)
            except Exception:  # a bug in one delivery must not end the others, nor the daemon
                log.exception("notify.internal_error", hook=hook.kind)

    async def _deliver_hook(self, job: Job, notice: Notice, hook: Hook) -> None:
        try:
            identity = await anyio.to_thread.run_sync(Identity.of, job.owner_uid)
        except UnknownUser as exc:
            await self._report(job, notice, hook, str(exc), tries=0)
            return
        timeout = self.live.current.notify_timeout
        told = {**identity.identity_env(), "PATH": SANE_PATH, **variables(notice)}
        if hook.kind == "url":
            told["DDPD_NOTIFY_JSON"] = json.dumps(asdict(notice))
        ran = await self._once(identity, hook.argv(timeout), told, answer=hook.kind == "url")
        if ran.error is not None:  # tried once more, after a pause
            await self.journal.event(job, "job.notify_retrying", hook=hook.kind, notice=notice.event,
                                     error=ran.error, **ran.facts())
            await anyio.sleep(RETRY_PAUSE)
            ran = await self._once(identity, hook.argv(timeout), told, answer=hook.kind == "url")
            tries = 2
        else:
            tries = 1
        if ran.error is None:
            await self.journal.event(job, "job.notified", hook=hook.kind, notice=notice.event, tries=tries,
                                     **ran.facts())
            return
        await self._report(job, notice, hook, ran.error, tries=2, facts=ran.facts())

    async def _report(self, job: Job, notice: Notice, hook: Hook, error: str, tries: int,
                      facts: dict[str, Any] | None = None) -> None:
        await self.journal.event(job, "job.notify_failed", hook=hook.kind, notice=notice.event, tries=tries,
                                 error=error, **(facts or {}))

    async def _once(self, identity: Identity, argv: list[str], env: dict[str, str], answer: bool = False) -> HookRun:
        """One run of a hook (or of the drawing) as the submitter, in a cgroup of its own (where there
        is a subtree), bounded; abandoned on cancel (the cgroup's end kills it)."""
        timeout = self.live.current.notify_timeout
        return await run_contained(
            HOOKS, self.subtree, f"{identity.uid}-{next(self._serial)}",
            lambda place: run_hook(argv, env, identity, timeout, place, answer=answer),
            uid=identity.uid, limiter=self._threads, abandon_on_cancel=True)
