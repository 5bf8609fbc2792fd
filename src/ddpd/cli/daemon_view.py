"""How ddpctl shows the daemon and its GPUs: `ddpctl daemon`'s grid (version, slots, pool, each fork
server's key, pid, memory, spares, forks and idle time, each GPU's memory, load, holders and
quarantine) and a rank's GPUs as the job tables show them. No I/O."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text

from ddpd.client import DaemonInfo, GpuView, PoolServerView, RankGpu

from .words import duration_text, size_text


def gpu_name(index: int, mig: int | None, uuid: str, short: bool = False) -> str:
    """A GPU as every view names it: the NVML index (``0``, ``0/mig1``) and the UUID (`short`: its
    first 8 hex digits, ``GPU-5d3f0a1b``, a prefix CUDA_VISIBLE_DEVICES accepts too)."""
    label = f"{index}" if mig is None else f"{index}/mig{mig}"
    if short and uuid.startswith(("GPU-", "MIG-")):
        uuid = uuid[:12]
    return f"{label} {uuid}" if uuid else label


def rank_gpu_text(gpus: list[RankGpu]) -> str:
    """A rank's GPUs: "0 GPU-5d3f0a1b (1.2 GiB)", "0 GPU-5d3f0a1b x0.5 (-)" (- where NVML does not say)."""
    return ", ".join(f"{gpu_name(g.index, g.mig, g.uuid, short=True)}{'' if g.share is None else f' x{g.share:g}'} "
                     f"({'-' if g.memory_used is None else size_text(g.memory_used)})"
                     + (f" {'/'.join(map(str, g.utilization[-6:]))}%" if g.utilization else "") for g in gpus)


def gpu_line(g: GpuView) -> str:
    """One GPU for `ddpctl daemon`: name, UUID, memory used of total, utilisation, holders, share held, draining."""
    memory = "?" if g.memory_used is None or g.memory_total is None else \
        f"{size_text(g.memory_used)} of {size_text(g.memory_total)}"
    util = "" if g.utilization is None else f", {g.utilization}% busy"
    held = ", ".join(g.jobs) if g.jobs else "free"
    if g.jobs and 0 < g.held < 1:
        held += f" ({g.held:.0%} held)"
    others = f" (+{g.other_processes} other process{'es' if g.other_processes > 1 else ''})" \
        if g.other_processes else ""
    draining = f"; draining: {', '.join(g.draining)}" if g.draining else ""
    draining += f"; QUARANTINED: {g.quarantined}" if g.quarantined else ""
    uuid = f" {g.uuid}" if g.uuid else ""
    return f"{g.name}{uuid}: {memory}{util}; {held}{others}{draining}"


def server_key(s: PoolServerView) -> str:
    """A fork server's key: "alice /home/alice/venv/bin/python env 3fa2c1d4e5f6"; its user alone
    ("bob") where the daemon keeps the rest from the viewer."""
    user = s.user or f"uid {s.uid}"
    return user if s.python is None else f"{user} {s.python} env {s.env or '?'}"


def server_line(s: PoolServerView) -> str:
    """One fork server for `ddpctl daemon`: key, pid, state, Pss (MiB, "?" where unknown), spares,
    forks served, idle time."""
    pid = "" if s.pid is None else f"pid {s.pid}, "
    pss = "? MiB" if s.pss is None else f"{s.pss / (1 << 20):.0f} MiB"
    idle = "" if s.idle is None else f", idle {duration_text(s.idle, whole=True)}"
    return (f"{server_key(s)}: {pid}{s.state}, Pss {pss}, {s.spares} spare{'' if s.spares == 1 else 's'}, "
            f"{s.forks} fork{'' if s.forks == 1 else 's'} served{idle}")


def daemon_grid(info: DaemonInfo) -> Table:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column(overflow="fold")
    rows = [
        ("version", f"{info.version} (protocol {info.protocol})"),
        ("pid", str(info.pid)),
        ("uptime", duration_text(info.uptime)),
        ("socket", info.socket),
        ("state dir", info.state_dir),
        ("running", str(info.running)),
        ("queued", str(info.queued)),
        ("cpu slots", _free_of(info.free_cpu_slots, info.cpu_slots)),
        ("gpus", _free_of(info.free_gpus, info.gpus)),
    ]
    if info.pool_state is not None:
        rows.append(("pool", info.pool_state))
    elif info.pool_ready is not None:
        rows.append(("warm pool", f"{info.pool_ready} ready"))
    rows.extend(("fork server", server_line(s)) for s in info.pool_servers)
    rows.extend((f"gpu {gpu_name(g.index, g.mig, '')}", gpu_line(g)) for g in info.gpu_devices)
    if info.gpu_note:
        rows.append(("gpu figures", f"unavailable: {info.gpu_note}"))
    for key, value in rows:
        grid.add_row(key, Text(value))
    return grid


def _free_of(free: int | None, total: int) -> str:
    return str(total) if free is None else f"{free} free of {total}"
