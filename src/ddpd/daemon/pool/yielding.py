"""How the warm pool's refills give way to running jobs (policy in `WarmPool._yield_to_jobs`,
docs/pool.md): a refill's threads at SCHED_IDLE (`set_priority`, where the daemon may move them
both ways: `can_idle`) and its cgroup at ``cpu.idle`` (`idle_cgroup`) while jobs hold cores; held,
its cgroup frozen (`freeze_cgroup`), beyond the cores the jobs' ranks leave free; and the pool's
state in words (`pool_state`) for ``ddpctl daemon``.
"""

from __future__ import annotations

import os
import resource

import structlog

from ..contain.cgroups import Cgroup

log = structlog.get_logger("ddpd")


def pool_state(size: int, ready: int, starting: int, busy: bool, idle_priority: bool, held: int = 0,
               servers: bool = False, forks: int = 0, spares: int = 0) -> str:
    """`WarmPool.state`: ``off``; ``warm (N ready)`` (``N fork servers ready, S forked, F forks served``
    with `servers`: S forked workers ready);
    ``cold (busy)`` while running jobs hold the cores (refills wait for them, or run at idle
    priority on cores the jobs leave, and are held beyond those); ``cold (refilling)``."""
    if size == 0:
        return "off"
    if servers and ready:
        return (f"warm ({ready} fork server{'s' if ready > 1 else ''} ready, {spares} forked, {forks} forks served"
                + (f", {starting} starting)" if starting else ")"))
    refilling = ""
    if starting:
        refilling = f", {starting} refilling" + (" at idle priority" if idle_priority and busy else "")
        refilling += f" ({held} held until a core is free)" if held else ""
    if ready:
        return f"warm ({ready} ready{refilling})"
    if busy:
        return f"cold (busy{refilling})"
    return "cold (refilling)" if starting else "cold"


def can_idle() -> bool:
    """Whether this daemon may move a pool interpreter's threads to SCHED_IDLE and back: root (or
    CAP_SYS_NICE's stand-in, an RLIMIT_NICE that allows nice 0; without either a thread cannot
    leave SCHED_IDLE)."""
    return os.geteuid() == 0 or resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20


def set_priority(pid: int, idle: bool) -> None:
    """Every thread of a pool interpreter to SCHED_IDLE or back to SCHED_OTHER; a thread that is gone
    is skipped, a policy the daemon may not change is logged."""
    policy = os.SCHED_IDLE if idle else os.SCHED_OTHER
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return
    for tid in tids:
        try:
            if os.sched_getscheduler(tid) != policy:
                os.sched_setscheduler(tid, policy, os.sched_param(0))
        except ProcessLookupError:
            continue
        except OSError as exc:
            log.warning("pool.priority_failed", pid=pid, tid=tid, error=str(exc))


def idle_cgroup(cgroup: Cgroup, idle: bool) -> None:
    """``cpu.idle`` of a pool interpreter's cgroup, where the cpu controller gives it one (inside a
    cgroup, SCHED_IDLE only ranks a thread against its own cgroup's threads, not the attempts')."""
    try:
        (cgroup.path / "cpu.idle").write_text("1" if idle else "0")
    except OSError:
        pass


def freeze_cgroup(cgroup: Cgroup, frozen: bool) -> bool:
    """Freeze (or thaw) a pool interpreter's cgroup (``cgroup.freeze``): a frozen refill takes no CPU
    at all, where even one at SCHED_IDLE slows a job beside it (the caches, the memory bus, a core's
    other hardware thread). Whether it is frozen now; a fatal signal still ends a frozen process."""
    try:
        (cgroup.path / "cgroup.freeze").write_text("1" if frozen else "0")
    except OSError as exc:
        log.warning("pool.freeze_failed", cgroup=str(cgroup.path), error=str(exc))
        return False
    return frozen
