"""`ddpctl stacks`: where every thread of a running job's ranks is, identical stacks shown once.

Text output: a line per rank that did not answer (and py-spy's dump of it, where the daemon has
py-spy), then each distinct stack under the ranks and the thread that share it, main threads
first; the worker's own threads (ddpd-dump, ddpd-heartbeat) only with --all-threads. JSON output:
the daemon's result as it is.
"""

from __future__ import annotations

import sys

from ddpd.client import Client, StackGroup, StacksResult, span_text

from .output import note, print_json


def rank_list(ranks: list[int]) -> str:
    """`[0, 1, 2, 5]` -> "0-2,5"."""
    return span_text(ranks)


OWN_THREADS = ("ddpd-",)  # the worker's own threads (ddpd-dump, ddpd-heartbeat): in every rank, never the story


def own_thread(group: StackGroup) -> bool:
    return group.thread.startswith(OWN_THREADS)


def render(result: StacksResult, all_threads: bool = False) -> str:
    """Text of the stacks; ddpd's own threads only with `all_threads`."""
    lines: list[str] = []
    for r in result.ranks:
        if r.native is not None:
            lines.append(f"== rank {r.rank} (pid {r.pid}) · py-spy ==")
            lines.append(r.native.rstrip("\n"))
            lines.append("")
    for g in result.groups:
        if own_thread(g) and not all_threads:
            continue
        label = "rank" if len(g.ranks) == 1 else "ranks"
        lines.append(f"== {label} {rank_list(g.ranks)} · thread {g.thread} ==")
        lines.append(g.stack.rstrip("\n"))
        lines.append("")
    return "\n".join(lines)


def show_stacks(client: Client, job_id: str, rank: int | None, native: bool, as_json: bool,
                all_threads: bool = False) -> None:
    result = client.stacks(job_id, rank=rank, native=native)
    if as_json:
        print_json(result)
        return
    answered = [r.rank for r in result.ranks if r.answered]
    note(f"job {result.job_id} attempt {result.attempt}: {len(answered)} of {len(result.ranks)} rank(s) answered")
    for r in result.ranks:
        if r.note:
            note(f"rank {r.rank} ({r.state}): {r.note}", "yellow")
        if r.omitted:
            note(f"rank {r.rank}: {r.omitted} more thread(s) not shown")
    if result.note:
        note(result.note, "yellow")
    hidden = sum(own_thread(g) for g in result.groups)
    if hidden and not all_threads:
        note(f"{hidden} stack(s) of ddpd's own threads (ddpd-dump, ddpd-heartbeat) not shown: --all-threads")
    sys.stdout.write(render(result, all_threads))
    sys.stdout.flush()
