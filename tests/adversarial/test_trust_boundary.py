"""Nothing another user can reach runs inside the root daemon, and a job's ports answer its owner only.

A root daemon serves two users made with useradd. Each attempt's store is served by the job's
rank 0 (its user, its cgroup) on the socket the daemon bound; a multi-node job's rendezvous (torch's
handler, which unpickles its store's state) runs in the job's rendezvous agent; every such port
is fenced (nftables, owner and root only). The tests are the shapes that reached root before:
a pickle in a rendezvous key, a stranger's connections and large values on a job's store, and a
taken local endpoint that another user's process holds. Each proves the daemon stays up and
answers within a bound, and that nothing is left: no process, cgroup or firewall rule.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import resource
import shutil
import socket
import subprocess
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream

from ddpd.daemon.contain.cgroups import probe
from ddpd.daemon.contain.identity import Identity
from ddpd.daemon.multinode.elastic import port_holders
from ddpd.protocol import JobSpec, RemoteError
from ddpd.protocol.control import JobView

from ..conftest import DaemonProc, assert_gone, running_daemon
from ..faults.helpers import events_of
from ..rawclient import ping_within
from ..scripts.helpers import gated, wait_waiting_at_gate
from ..scripts.userpython import USER_PYTHON
from ..users import plain_env, submit_as

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.public_tmp(0o1777),
    pytest.mark.xdist_group("users"),  # useradd/userdel lock /etc/passwd: one worker at a time
    pytest.mark.skipif(os.geteuid() != 0, reason="a shared box needs a root daemon and real users"),
]

TIMEOUT = 180
PING_BOUND = 5.0
FLOOD = 1100  # connections: more than a default descriptor limit of 1024
BIG = 8 << 20  # bytes per value
FENCED = shutil.which("nft") is not None

# a user's connections to a TCP port: how many were accepted and refused, as one JSON line
CONNECT = r"""
import json, socket, sys
port, n = int(sys.argv[1]), int(sys.argv[2])
seen, held = {"connected": 0, "refused": 0}, []
for _ in range(n):
    try:
        held.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        seen["connected"] += 1
    except OSError:
        seen["refused"] += 1
print(json.dumps(seen), flush=True)
"""

# a user's process listening on a port until its stdin closes
LISTEN = r"""
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen()
print("ready", flush=True)
sys.stdin.read()
"""


class RunsOnUnpickle:
    """What a stranger writes into a rendezvous key: `pickle.loads` of it runs a shell command."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.system, (self.command,)


def box_config(base: Path, *lines: str) -> Path:
    """The daemon's config; without nftables its multi-node jobs run only where the operator allows
    them unfenced (test_port_fences proves the refusal), so these tests allow them there."""
    config = base / "ddpd.toml"
    config.write_text("\n".join([*lines, *([] if FENCED else ["allow_unfenced = true"]), ""]))
    return config


@asynccontextmanager
async def shared_box(base: Path) -> AsyncIterator[DaemonProc]:
    config = box_config(base, 'socket_mode = "0666"')
    async with running_daemon(base, "--config", str(config), "--gpus", "0") as d:
        yield d


def as_user_spec(d: DaemonProc, gate: Path, **kw: Any) -> JobSpec:
    spec: JobSpec = gated(d, gate, python=USER_PYTHON, environ=plain_env(), **kw)
    return spec


async def run_as(who: Identity, *argv: str) -> str:
    done = await anyio.run_process([USER_PYTHON, *argv], user=who.uid, group=who.gid, extra_groups=[], cwd="/",
                                   env=plain_env(), check=False)
    assert done.returncode == 0, done.stderr.decode()
    return done.stdout.decode().strip()


async def connect_as(who: Identity, port: int, n: int = 1) -> dict[str, int]:
    seen: dict[str, int] = json.loads(await run_as(who, "-c", CONNECT, str(port), str(n)))
    return seen


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


def fence_rules(job_id: str) -> list[str]:
    """The firewall rules that name the job (none without nft)."""
    if not FENCED:
        return []
    out = subprocess.run(["nft", "list", "ruleset"], capture_output=True, text=True, check=False).stdout
    return [line.strip() for line in out.splitlines() if f" {job_id}/" in line]


def cgroups_of(job_id: str) -> list[Path]:
    support = probe()
    if support.path is None:
        return []
    return [p for depth in range(1, 5) for p in support.path.glob("*/" * depth + f"{job_id}-*")]


def cgroup_of(pid: int) -> str:
    return Path(f"/proc/{pid}/cgroup").read_text().strip().rpartition(":")[2]


async def eventually(predicate: Callable[[], bool], timeout: float) -> None:
    """A state only the file system shows (what a payload wrote: no event announces it), looked at
    every 50 ms, within `timeout`."""
    with anyio.fail_after(timeout):
        while True:
            if predicate():
                return
            await anyio.sleep(0.05)


async def wait_done(d: DaemonProc, job_id: str) -> JobView:
    with anyio.fail_after(TIMEOUT):
        return await d.client.wait(job_id)


def assert_left_nothing(job_id: str) -> None:
    assert fence_rules(job_id) == [], fence_rules(job_id)
    assert cgroups_of(job_id) == [], cgroups_of(job_id)


async def assert_fenced(d: DaemonProc, job_id: str, port: int, owner: Identity, stranger: Identity) -> None:
    """Only the owner (and root) on this host reach the port; without nft, the job says so."""
    if not FENCED:
        unfenced = [e for e in await events_of(d, job_id) if e.kind == "job.port_unfenced"]
        assert unfenced and unfenced[0].data["port"] == port, unfenced
        return
    assert len([r for r in fence_rules(job_id) if f"dport {port} " in r]) == 1, fence_rules(job_id)
    assert await connect_as(stranger, port) == {"connected": 0, "refused": 1}
    assert await connect_as(owner, port) == {"connected": 1, "refused": 0}


def flood_as_root(port: int) -> list[socket.socket]:
    """FLOOD connections to the port, accepted by whoever serves it (root passes the fence)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < FLOOD + 256:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, FLOOD + 1024), hard))
    held = []
    try:
        for _ in range(FLOOD):
            held.append(socket.create_connection(("127.0.0.1", port), timeout=10))
    except BaseException:
        for s in held:
            s.close()
        raise
    return held


def fill_store(port: int, values: int) -> None:
    """`values` values of BIG bytes written into the store on `port` (a plain TCPStore client)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    for i in range(values):
        store.set(f"stranger/{i}", b"x" * BIG)


async def test_a_jobs_store_is_served_by_its_rank_0_and_no_connection_or_value_reaches_the_daemon(
    users: tuple[Identity, Identity], public_tmp: Path
) -> None:
    """Bugs: every attempt's TCPStore lived in the root daemon: a stranger's 1,019 connections made
    accept() fail with EMFILE and the daemon exited; 64 values of 8 MiB grew it by 550 MB."""
    ann, bob = users
    gate = public_tmp / "gate"
    async with shared_box(public_tmp) as d:
        job_id = await submit_as(ann, d, as_user_spec(d, gate, nproc=2))
        await wait_waiting_at_gate(d, job_id, ranks=2)
        view = await d.client.status(job_id)
        port = view.store_port
        assert port is not None
        rank0 = next(r for r in view.ranks if r.rank == 0)
        holders = await anyio.to_thread.run_sync(port_holders, "127.0.0.1", port)
        assert [(h.pid, h.uid) for h in holders] == [(rank0.pid, ann.uid)], holders
        if probe().path is not None:
            assert cgroup_of(rank0.pid).rsplit("/", 1)[-1].startswith(f"{job_id}-a1"), cgroup_of(rank0.pid)
        await assert_fenced(d, job_id, port, ann, bob)

        fds, rss = len(os.listdir(f"/proc/{d.proc.pid}/fd")), rss_kib(d.proc.pid)
        seen = await connect_as(bob, port, FLOOD)
        assert seen["connected"] + seen["refused"] == FLOOD
        if FENCED:
            assert seen["connected"] == 0, seen
        held = await anyio.to_thread.run_sync(flood_as_root, port)
        try:
            await ping_within(d.client, PING_BOUND)
            await anyio.to_thread.run_sync(fill_store, port, 8)
            await ping_within(d.client, PING_BOUND)
            assert len(os.listdir(f"/proc/{d.proc.pid}/fd")) <= fds + 8
            assert rss_kib(d.proc.pid) - rss < 32 << 10, (rss, rss_kib(d.proc.pid))  # 64 MiB went to rank 0
        finally:
            for s in held:
                s.close()
        gate.touch()
        done = await wait_done(d, job_id)
        assert done.state == "SUCCEEDED", done.root_cause
    assert_left_nothing(job_id)


async def test_a_pickle_in_a_multinode_rendezvous_runs_as_its_job_user_never_as_root(
    users: tuple[Identity, Identity], public_tmp: Path
) -> None:
    """Bug: the daemon ran torch's rendezvous handler, which unpickles its store's state key: a
    stranger who wrote base64(pickle) into `torch.rendezvous.<id>` ran code as root."""
    ann, bob = users
    gate, proof, port = public_tmp / "gate", public_tmp / "proof", free_port()
    async with shared_box(public_tmp) as d:
        spec = as_user_spec(d, gate, nproc=1, nnodes="1:2", rdzv_endpoint=f"127.0.0.1:{port}", rdzv_id="tb",
                            rdzv_last_call=1.0, rdzv_keep_alive=3.0)
        job_id = await submit_as(ann, d, spec)
        await wait_waiting_at_gate(d, job_id)
        holders = await anyio.to_thread.run_sync(port_holders, "127.0.0.1", port)
        assert [(h.uid, h.agent, h.ppid) for h in holders] == [(ann.uid, True, d.proc.pid)], holders
        agent = holders[0].pid
        assert f"{job_id}-rdzv" in cgroup_of(agent) or probe().path is None, cgroup_of(agent)
        await assert_fenced(d, job_id, port, ann, bob)

        # what a stranger elsewhere on the cluster network could still write (root here, past the fence)
        payload = base64.b64encode(pickle.dumps(RunsOnUnpickle(f"id -u > {proof}")))
        await anyio.to_thread.run_sync(write_key, port, "torch.rendezvous.tb", payload)
        await eventually(lambda: proof.exists() and bool(proof.read_text().strip()), 60)
        assert proof.read_text().strip() == str(ann.uid)
        assert proof.stat().st_uid == ann.uid
        await ping_within(d.client, PING_BOUND)
        await d.client.cancel(job_id)
        done = await wait_done(d, job_id)
        assert done.state in ("FAILED", "CANCELLED"), done.state
        await d.wait_log(lambda e: e.get("event") == "nodes.agent_stopped" and e.get("pid") == agent, 30)
        assert_gone(agent)  # the job's rendezvous agent ended (and was reaped) with it
    assert_left_nothing(job_id)


def write_key(port: int, key: str, value: bytes) -> None:
    import torch.distributed as dist

    dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30)).set(key, value)


async def test_two_daemons_on_one_host_form_one_job_and_another_users_port_is_refused(
    users: tuple[Identity, Identity], public_tmp: Path
) -> None:
    """torchrun's one-host multi-node recipe: the second daemon joins the rendezvous the first one's
    agent serves on 127.0.0.1 (same user, same run id), and says which daemon serves it; a port
    another user's process holds is never joined."""
    _, bob = users
    port = free_port()
    (public_tmp / "a").mkdir()
    (public_tmp / "b").mkdir()
    kw: dict[str, Any] = {"nnodes": "2", "nproc": 1, "rdzv_endpoint": f"127.0.0.1:{port}", "rdzv_id": "onehost",
                          "rdzv_keep_alive": 3.0, "steps": 20, "env": {"GLOO_SOCKET_IFNAME": "lo"}}
    async with running_daemon(public_tmp / "a", "--config", str(box_config(public_tmp / "a"))) as a, \
            running_daemon(public_tmp / "b", "--config", str(box_config(public_tmp / "b"))) as b:
        ja = await a.client.submit(a.spec(**kw))
        await a.wait_log(lambda e: e.get("event") == "nodes.opened", timeout=TIMEOUT)
        jb = await b.client.submit(b.spec(**kw))
        with anyio.fail_after(TIMEOUT):
            va, vb = await a.client.wait(ja), await b.client.wait(jb)
        assert (va.state, vb.state) == ("SUCCEEDED", "SUCCEEDED"), (va.root_cause, vb.root_cause)
        assert sorted(r.rank for r in va.ranks + vb.ranks) == [0, 1]
        assert len({r.checksum for r in va.ranks + vb.ranks}) == 1
        assert [n.detail for n in va.nodes if n.local] == ["rendezvous served by this daemon"]
        assert [f"the daemon with pid {a.proc.pid} " in n.detail for n in vb.nodes if n.local] == [True], vb.nodes

        await a.wait_log(lambda e: e.get("event") == "nodes.agent_stopped", timeout=TIMEOUT)  # the port is free
        listener = await anyio.open_process([USER_PYTHON, "-c", LISTEN, str(port)], user=bob.uid, group=bob.gid,
                                            extra_groups=[], cwd="/", env=plain_env())
        try:
            assert listener.stdout is not None
            with anyio.fail_after(60):
                await BufferedByteReceiveStream(listener.stdout).receive_until(b"\n", 100)
            with pytest.raises(RemoteError, match=f"port {port} on 127.0.0.1 is taken by pid {listener.pid} "
                                                  f"\\(uid {bob.uid}\\)"):
                await b.client.submit(b.spec(**{**kw, "rdzv_id": "other"}))
        finally:
            listener.kill()
            await listener.wait()
    for job in (ja, jb):
        assert_left_nothing(job)
