"""Another user's writes into a multi-node job's rendezvous store, tried end to end as that user.

A root daemon with port fences (nftables) serves two users made with useradd. Each user's own
process (USER_PYTHON, a plain TCPStore client, as a cluster node's process would write) plants what
reached root before: a pickle in the rendezvous state key, which torch's handler unpickles, and a
forged `ddpd/failed` record, which ends a job on every node and names its root cause. The same
writes by the job's owner (or by root, a process elsewhere on the cluster network, past the fence)
show that they reach the store and take effect, so each test can fail: a stranger's pickle runs
only as its writer, in the stranger's own job, never as the other user or as root; a stranger's
forged failure changes nothing. Without fences (no nftables) every local user reaches these ports,
as docs/identity.md says: the tests need nftables (`make nftables`).
"""

from __future__ import annotations

import base64
import os
import pickle
from pathlib import Path

import anyio
import anyio.to_thread
import pytest

from ddpd.daemon.contain.identity import Identity
from ddpd.daemon.multinode.elastic import port_holders
from ddpd.protocol import JobSpec, JobState
from ddpd.protocol.control import JobView

from ..conftest import DaemonProc, assert_gone
from ..rawclient import ping_within
from ..scripts.helpers import wait_waiting_at_gate
from ..scripts.userpython import USER_PYTHON
from ..users import plain_env, submit_as
from .test_trust_boundary import (
    FENCED,
    PING_BOUND,
    RunsOnUnpickle,
    as_user_spec,
    assert_left_nothing,
    eventually,
    free_port,
    shared_box,
    wait_done,
    write_key,
)

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.xdist_group("users"),  # useradd/userdel lock /etc/passwd: one worker at a time
    pytest.mark.public_tmp(0o1777),  # the payloads write their proofs here, as whoever runs them
    pytest.mark.skipif(os.geteuid() != 0, reason="a root daemon and real users"),
    pytest.mark.skipif(not FENCED, reason="needs nftables (make nftables): unfenced, every local user "
                                          "reaches a multi-node job's rendezvous store"),
]

WRITE_TIMEOUT = 60  # one writer process: import torch, connect (a fenced connect retries for STORE_WAIT)
PROOF_WAIT = 60  # a planted pickle is read at the handler's next keep-alive (1 s here)

# a user's write into the TCPStore on 127.0.0.1:PORT, as one line: `written <value the key holds>`, or
# `refused <error>` when no connection is accepted within 5 s (the fence resets each one)
WRITE = r"""
import sys
from datetime import timedelta
import torch.distributed as dist
port, op, key, value = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
try:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5))
    if op == "set":
        store.set(key, value)
        held = store.get(key)
    else:
        held = store.compare_set(key, "", value)  # the first failure written wins, as the agents write it
except Exception as exc:
    print("refused", type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "", flush=True)
else:
    print("written", bytes(held).decode(errors="replace"), flush=True)
"""


async def write_as(who: Identity, port: int, op: str, key: str, value: str) -> str:
    """What `who`'s own process saw writing `value` into `key` on the store at 127.0.0.1:`port`."""
    with anyio.fail_after(WRITE_TIMEOUT):
        done = await anyio.run_process([USER_PYTHON, "-c", WRITE, str(port), op, key, value], user=who.uid,
                                       group=who.gid, extra_groups=[], cwd="/", env=plain_env(), check=False)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    return done.stdout.decode().strip()


def pickled(command: str) -> str:
    """What a stranger writes into a rendezvous state key: base64(pickle) that runs `command`."""
    return base64.b64encode(pickle.dumps(RunsOnUnpickle(command))).decode()


def multinode_spec(d: DaemonProc, gate: Path, port: int, rdzv_id: str) -> JobSpec:
    return as_user_spec(d, gate, nproc=1, nnodes="1:2", rdzv_endpoint=f"127.0.0.1:{port}", rdzv_id=rdzv_id,
                        rdzv_last_call=1.0, rdzv_keep_alive=3.0)


async def agent_of(d: DaemonProc, port: int, owner: Identity) -> int:
    """The pid of the rendezvous agent serving the endpoint: the job's user's, the daemon's child."""
    holders = await anyio.to_thread.run_sync(port_holders, "127.0.0.1", port)
    assert [(h.uid, h.agent, h.ppid) for h in holders] == [(owner.uid, True, d.proc.pid)], holders
    return holders[0].pid


async def cancel_and_wait(d: DaemonProc, job_id: str, agent: int) -> JobView:
    await d.client.cancel(job_id)
    done = await wait_done(d, job_id)
    await d.wait_log(lambda e: e.get("event") == "nodes.agent_stopped" and e.get("pid") == agent, 30)
    assert_gone(agent)
    return done


def proof_of(path: Path) -> tuple[str, int] | None:
    """What a payload wrote (`id -u` of whoever ran it) and the file's owner; None while it has not run."""
    if not path.exists() or not (text := path.read_text().strip()):
        return None
    return text, path.stat().st_uid


async def test_a_pickle_another_user_plants_in_a_rendezvous_runs_only_as_its_writer(
    users: tuple[Identity, Identity], public_tmp: Path
) -> None:
    """Bob, as bob, plants a pickle in Ann's job's rendezvous state key and in his own job's. His own
    job's handler runs it, as bob; Ann's store never accepts his connection, and his pickle has not
    run there by the time a pickle root wrote past the fence later has run (as Ann, never as root)."""
    ann, bob = users
    gate = public_tmp / "gate"
    in_anns, in_his, roots = public_tmp / "in-anns", public_tmp / "in-his", public_tmp / "roots"
    port_a, port_b = free_port(), free_port()
    async with shared_box(public_tmp) as d:
        anns = await submit_as(ann, d, multinode_spec(d, gate, port_a, "tba"))
        his = await submit_as(bob, d, multinode_spec(d, gate, port_b, "tbb"))
        for job_id in (anns, his):
            await wait_waiting_at_gate(d, job_id)
        agents = [await agent_of(d, port_a, ann), await agent_of(d, port_b, bob)]

        tried = await write_as(bob, port_a, "set", "torch.rendezvous.tba", pickled(f"id -u > {in_anns}"))
        assert tried.startswith("refused "), tried
        own = await write_as(bob, port_b, "set", "torch.rendezvous.tbb", pickled(f"id -u > {in_his}"))
        assert own.startswith("written "), own
        await eventually(lambda: proof_of(in_his) is not None, PROOF_WAIT)
        assert proof_of(in_his) == (str(bob.uid), bob.uid)

        payload = pickled(f"id -u > {roots}").encode()  # a process past the fence (root here) writes
        await anyio.to_thread.run_sync(write_key, port_a, "torch.rendezvous.tba", payload)
        await eventually(lambda: proof_of(roots) is not None, PROOF_WAIT)
        assert proof_of(roots) == (str(ann.uid), ann.uid)  # Ann's handler read its key since Bob tried
        assert proof_of(in_anns) is None and not in_anns.exists()
        await ping_within(d.client, PING_BOUND)
        for job_id, agent in zip((anns, his), agents, strict=True):
            done = await cancel_and_wait(d, job_id, agent)
            assert done.state in (JobState.FAILED, JobState.CANCELLED), done.state
    for job_id in (anns, his):
        assert_left_nothing(job_id)


async def test_a_failed_record_another_user_forges_changes_nothing(
    users: tuple[Identity, Identity], public_tmp: Path
) -> None:
    """Bob, as bob, writes a `ddpd/failed` record into Ann's running job's rendezvous round, as a
    failed node's daemon writes it. His connection is refused and the job runs on; the same write
    by Ann lands first-writer-wins and fails the job with her text: Bob's never reached the store."""
    ann, bob = users
    gate, port = public_tmp / "gate", free_port()
    key = "torch.rendezvous.tbf.0/ddpd/failed"  # round 0's prefix (torch's PrefixStore) and the agents' key
    async with shared_box(public_tmp) as d:
        job_id = await submit_as(ann, d, multinode_spec(d, gate, port, "tbf"))
        await wait_waiting_at_gate(d, job_id)
        agent = await agent_of(d, port, ann)

        tried = await write_as(bob, port, "compare_set", key, "node 1 (host forged) failed: forged by bob")
        assert tried.startswith("refused "), tried
        assert (await d.client.status(job_id)).state == JobState.RUNNING
        own = await write_as(ann, port, "compare_set", key, "node 1 (host anns) failed: written by ann")
        assert own == "written node 1 (host anns) failed: written by ann", own
        done = await wait_done(d, job_id)
        assert done.state == JobState.FAILED and done.root_cause is not None, done
        said = f"{done.root_cause.detail} {done.root_cause.message}"
        assert "written by ann" in said and "bob" not in said, done.root_cause
        await d.wait_log(lambda e: e.get("event") == "nodes.agent_stopped" and e.get("pid") == agent, 30)
        assert_gone(agent)
        await ping_within(d.client, PING_BOUND)
    assert_left_nothing(job_id)
