"""Which of a job's global ranks this daemon runs, and where the others run: what every per-rank
request (logs, stacks) checks a rank against.

A single-node job runs ranks 0..nproc-1 here. A multi-node job's ranks here are the global ranks
(torchrun's numbering across nodes, as `status` lists them) that its attempt started on this
daemon: the current attempt's from memory (`Job.ranks`), an earlier attempt's from the journal (an
elastic job's node ranks, and so its global ranks, may change from one attempt to the next). A rank
that the job's node table (`Job.nodes`) places on another node is an `OtherNodeError` naming that
node, its host and its daemon; a rank that no node has is `NotFoundError`. A rank of this node that
its attempt has not started yet, or any rank before the nodes have formed (which ranks will run
here is not known), is let through: a follower waits for its log.
"""

from __future__ import annotations

from collections.abc import Collection

from ...protocol.nodes import elsewhere_text, node_of, span_text
from ...protocol.spec import is_multinode
from ..store.errors import NotFoundError, OtherNodeError
from ..store.journal import Journal
from ..store.records import Job


def ranks_in_memory(job: Job, attempt: int) -> list[int] | None:
    """The ranks this daemon runs in `attempt`, as memory knows them; None: only the journal does (an
    earlier attempt of a multi-node job)."""
    if not is_multinode(job.spec):
        return list(range(job.spec.nproc))
    if attempt != job.attempt:
        return None
    return sorted({r.rank for r in job.ranks if r.attempt == attempt})


async def held_ranks(journal: Journal, job: Job, attempt: int) -> list[int]:
    """The global ranks this daemon runs (or ran) in `attempt`."""
    found = ranks_in_memory(job, attempt)
    return found if found is not None else await journal.attempt_ranks(job.id, attempt)


def check_rank(job: Job, rank: int, held: Collection[int]) -> None:
    """`rank` is one this daemon can answer for (see the module docstring), else the error that says
    where it runs."""
    if rank in held:
        return
    if not is_multinode(job.spec):
        raise NotFoundError(f"job {job.id} has no rank {rank}")
    home = node_of(job.nodes, rank)
    if home is not None and not home.local:
        raise OtherNodeError(elsewhere_text(rank, home))
    if home is None and job.nodes:
        world = [r for n in job.nodes for r in n.ranks]
        raise NotFoundError(f"job {job.id} has no rank {rank}: its ranks are {span_text(world)}, "
                            f"on {len(job.nodes)} nodes")
