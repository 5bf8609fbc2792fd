"""A job's port fence names exactly what the job owns, ends with its daemon, and is never skipped for
a multi-node job (issue 34, findings 2 and 3).

A root daemon serves two users made with useradd; their connections are made by their own
processes, so the rules' `meta skuid` sees them. The shapes: a multi-node endpoint on 127.0.0.2
beside another user's own service on 127.0.0.1 (same port), a daemon killed with SIGKILL while its
job's port is fenced and the rules an older daemon (or one on a kernel without owner tables) left,
a daemon without CAP_NET_ADMIN or without libnftables, and the fence API itself on IPv6 and
wildcard binds. Each proves that nothing is left: no process, cgroup or firewall rule.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream

from ddpd.daemon.contain.identity import Identity
from ddpd.daemon.contain.portfence import Fences, daemon_tag
from ddpd.protocol import JobState, RemoteError

from ..conftest import DaemonProc, assert_nothing_left, running_daemon, start_daemon, stop_daemon
from ..faults.helpers import await_gone, become_subreaper, events_of
from ..scripts.helpers import wait_waiting_at_gate
from ..scripts.userpython import USER_PYTHON
from ..users import plain_env, submit_as
from .test_trust_boundary import as_user_spec, assert_left_nothing, fence_rules, wait_done

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.public_tmp(0o1777),
    pytest.mark.xdist_group("users"),  # useradd/userdel lock /etc/passwd: one worker at a time
    pytest.mark.skipif(os.geteuid() != 0, reason="port fences need a root daemon and real users"),
]

NFT = shutil.which("nft")
needs_nft = pytest.mark.skipif(NFT is None, reason="needs nftables (make nftables)")
NO_NET_ADMIN = ("setpriv", "--inh-caps=-net_admin", "--bounding-set=-net_admin", "--")
STALE = "test-stale"  # the label of the rules this module leaves as a killed daemon would

# a user's connection to HOST PORT: "connected" or "refused"
REACH = r"""
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10).close()
    print("connected", flush=True)
except OSError:
    print("refused", flush=True)
"""

# a user's own service on HOST PORT until its stdin closes
LISTEN = r"""
import socket, sys
s = socket.socket(socket.AF_INET6 if ":" in sys.argv[1] else socket.AF_INET)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen()
print("ready", flush=True)
sys.stdin.read()
"""


async def reaches(who: Identity, host: str, port: int) -> bool:
    """Whether a process of `who` connects to host:port."""
    done = await anyio.run_process([USER_PYTHON, "-c", REACH, host, str(port)], user=who.uid, group=who.gid,
                                   extra_groups=[], cwd="/", env=plain_env(), check=False)
    assert done.returncode == 0, done.stderr.decode()
    return done.stdout.decode().strip() == "connected"


@asynccontextmanager
async def service_of(who: Identity, host: str, port: int) -> AsyncIterator[None]:
    """A process of `who` listening on host:port for the block (ready when entered), then gone."""
    proc = await anyio.open_process([USER_PYTHON, "-c", LISTEN, host, str(port)], user=who.uid, group=who.gid,
                                    extra_groups=[], cwd="/", env=plain_env())
    try:
        assert proc.stdout is not None
        with anyio.fail_after(60):
            assert await BufferedByteReceiveStream(proc.stdout).receive_until(b"\n", 100) == b"ready"
        yield
    finally:
        proc.kill()
        with anyio.fail_after(10):
            await proc.wait()


def tcp(host: str) -> socket.socket:
    return socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)


def free_port(*hosts: str) -> int:
    """A port free on every one of `hosts` now."""
    while True:
        with tcp(hosts[0]) as first:
            first.bind((hosts[0], 0))
            port = int(first.getsockname()[1])
            try:
                for host in hosts[1:]:
                    with tcp(host) as other:
                        other.bind((host, port))
            except OSError:
                continue
            return port


def ruleset() -> str:
    assert NFT is not None
    return subprocess.run([NFT, "list", "ruleset"], capture_output=True, text=True, check=True).stdout


@asynccontextmanager
async def shared_box(base: Path, *lines: str, prefix: tuple[str, ...] = ()) -> AsyncIterator[DaemonProc]:
    config = base / "ddpd.toml"
    config.write_text("\n".join(['socket_mode = "0666"', *lines, ""]))
    async with running_daemon(base, "--config", str(config), "--gpus", "0", prefix=prefix) as d:
        yield d


def multinode(port: int, host: str = "127.0.0.1") -> dict[str, Any]:
    """A multi-node job's keywords: one node of at most two, the endpoint at host:port."""
    return {"nnodes": "1:2", "rdzv_endpoint": f"{host}:{port}", "rdzv_id": f"pf{port}", "rdzv_last_call": 1.0,
            "rdzv_keep_alive": 3.0}


@needs_nft
async def test_a_fence_names_the_address_bound_and_the_same_port_elsewhere_is_not_fenced(
    users: tuple[Identity, Identity], public_tmp: Path
) -> None:
    """Bug (issue 34, finding 2): the rules were `tcp dport P` on every local address: a multi-node
    job's endpoint on 127.0.0.2:P fenced P on 127.0.0.1 too, and another user's own service there
    answered no one but root and the job's owner for the job's life."""
    ann, bob = users
    gate, port = public_tmp / "gate", free_port("127.0.0.1", "127.0.0.2")
    async with shared_box(public_tmp) as d:
        job_id = await submit_as(ann, d, as_user_spec(d, gate, nproc=1, **multinode(port, "127.0.0.2")))
        await wait_waiting_at_gate(d, job_id)
        store = (await d.client.status(job_id)).store_port
        assert store is not None
        async with service_of(bob, "127.0.0.1", port):  # bob's own, beside ann's endpoint
            assert await reaches(bob, "127.0.0.1", port)
            assert await reaches(ann, "127.0.0.1", port)
        for p in (port, store):  # the job's endpoint and worker store: ann's alone
            assert not await reaches(bob, "127.0.0.2", p)
            assert await reaches(ann, "127.0.0.2", p)
        rules = fence_rules(job_id)
        assert sorted(r.split(" meta skuid")[0] for r in rules) == sorted(
            f"ip daddr 127.0.0.2 tcp dport {p}" for p in (port, store)), rules
        gate.touch()
        done = await wait_done(d, job_id)
        assert done.state == "SUCCEEDED", done.root_cause
    assert_left_nothing(job_id)


def leave_stale_rules(tag: str, pid: int) -> None:
    """What a killed daemon of `tag` leaves where tables cannot be owned (Linux before 5.12), and
    what an earlier version left in the table every daemon shared: made by `nft`, so owned by no one."""
    assert NFT is not None
    rule = f'ip daddr 127.0.0.77 tcp dport 9 meta skuid != 0 reject with tcp reset comment "{tag} p{pid} {STALE}/'
    chain = "{ type filter hook output priority 0; policy accept; }"
    script = "".join(f"add table inet {t}\nadd chain inet {t} output {chain}\nadd rule inet {t} output {rule}a{i}\"\n"
                     for i, t in enumerate((tag, "ddpd")))
    subprocess.run([NFT, "-f", "-"], input=script, text=True, check=True, capture_output=True)


def remove_stale_rules(tag: str) -> None:
    """This module's stale rules, wherever a test that failed left them (nothing when it passed)."""
    assert NFT is not None
    subprocess.run([NFT, "delete", "table", "inet", tag], check=False, capture_output=True)  # an owner's: refused
    listing = subprocess.run([NFT, "-a", "list", "chain", "inet", "ddpd", "output"], capture_output=True, text=True,
                             check=False).stdout
    for line in listing.splitlines():
        if f" {STALE}/" in line or f'"{tag} ' in line:
            handle = line.rsplit("# handle ", 1)[1].strip()
            subprocess.run([NFT, "delete", "rule", "inet", "ddpd", "output", "handle", handle], check=False,
                           capture_output=True)
    left = subprocess.run([NFT, "list", "chain", "inet", "ddpd", "output"], capture_output=True, text=True,
                          check=False).stdout
    if left and " reject " not in left and " accept" not in left.split("policy accept", 1)[-1]:
        # the shared table leave_stale_rules made, now empty: gone too (what the test made, it removes)
        subprocess.run([NFT, "delete", "table", "inet", "ddpd"], check=False, capture_output=True)


@needs_nft
async def test_a_killed_daemons_rules_block_no_one_and_a_start_sweeps_what_others_left(
    users: tuple[Identity, Identity], public_tmp: Path
) -> None:
    """Bug (issue 34, finding 2): the rules of a daemon killed with SIGKILL stayed until its next
    start, refusing the port's next owner meanwhile. Now the kernel removes the daemon's table with
    its process; what a daemon on a kernel without owner tables (or an earlier version) leaves is
    swept at the next start."""
    ann, bob = users
    gate = public_tmp / "gate"
    config = public_tmp / "ddpd.toml"
    config.write_text('socket_mode = "0666"\n')
    flags = ("--config", str(config), "--gpus", "0")
    become_subreaper()  # the killed daemon's ranks come here to be reaped
    tag = daemon_tag(public_tmp / "state")
    try:
        async with anyio.create_task_group() as tg:
            d = await start_daemon(tg, public_tmp, *flags)
            try:
                job_id = await submit_as(ann, d, as_user_spec(d, gate, nproc=1))
                await wait_waiting_at_gate(d, job_id)
                view = await d.client.status(job_id)
                port = view.store_port
                assert port is not None and not await reaches(bob, "127.0.0.1", port)  # fenced while it runs
                d.proc.send_signal(signal.SIGKILL)
                with anyio.fail_after(10):
                    await d.proc.wait()
                for rank in view.ranks:
                    assert rank.pid is not None
                    await await_gone(rank.pid, 10)
            finally:
                if d.proc.returncode is None:
                    d.proc.kill()
            async with service_of(bob, "127.0.0.1", port):  # the port's next owner, before any start
                assert await reaches(bob, "127.0.0.1", port)
            assert fence_rules(job_id) == [], fence_rules(job_id)  # gone with the daemon

            # The killed daemon's rules, as its tag and a live pid: a daemon of the other xdist worker
            # starting meanwhile sweeps the rules of a dead pid too, so only a live pid leaves them
            # for this daemon's start alone (its own tag's earlier runs) to sweep.
            stand_in = await anyio.open_process([sys.executable, "-c", "import sys; sys.stdin.read()",
                                                 "ddpd-stand-in"], stdout=None, stderr=None)
            try:
                await anyio.to_thread.run_sync(leave_stale_rules, tag, stand_in.pid)
                assert ruleset().count(f" {STALE}/") == 2
                d = await start_daemon(tg, public_tmp, *flags, state_dir=d.state_dir)
            finally:
                assert stand_in.stdin is not None
                await stand_in.stdin.aclose()
                with anyio.fail_after(10):
                    assert await stand_in.wait() == 0
            try:
                assert f" {STALE}/" not in ruleset()
                assert (await d.wait_log(lambda e: e.get("event") == "fence.swept"))["rules"] >= 2
                assert (await d.wait_log(lambda e: e.get("event") == "fence.ready"))["owned"] is True
                view = await d.client.status(job_id)
                assert (view.state, view.reason) == (JobState.FAILED, "daemon_restart")
            finally:
                assert await stop_daemon(d) == 0
        assert_nothing_left([view])
        assert_left_nothing(job_id)
        assert tag not in ruleset()
    finally:
        await anyio.to_thread.run_sync(remove_stale_rules, tag)


async def test_without_a_working_fence_a_multinode_job_is_refused_and_a_one_node_job_runs_unfenced(
    short_tmp: Path,
) -> None:
    """Bug (issue 34, finding 3): without nft or CAP_NET_ADMIN a multi-node job ran with only a
    `job.port_unfenced` event, and another user's pickle in its rendezvous store ran as its owner."""
    async with running_daemon(short_tmp, prefix=NO_NET_ADMIN) as d:
        with pytest.raises(RemoteError, match=r"cannot fence job ports .*CAP_NET_ADMIN.*allow_unfenced = true"):
            await d.client.submit(d.spec(task="two-layer", nproc=1, steps=2, **multinode(free_port("127.0.0.1"))))
        unavailable = await d.wait_log(lambda e: e.get("event") == "fence.unavailable")
        assert "CAP_NET_ADMIN" in unavailable["reason"], unavailable
        view = await d.run(d.spec(task="two-layer", nproc=1, steps=2))
        assert view.state == JobState.SUCCEEDED, view.root_cause
        unfenced = [e.data for e in await events_of(d, view.id) if e.kind == "job.port_unfenced"]
        assert [u["port"] for u in unfenced] == [view.store_port], unfenced
        assert "CAP_NET_ADMIN" in unfenced[0]["reason"]
    assert fence_rules(view.id) == []


async def test_allow_unfenced_runs_a_multinode_job_unfenced_and_says_so(short_tmp: Path) -> None:
    """Issue 34, finding 3: the operator's opt-out. A daemon whose nftables library is missing
    refuses a multi-node job until `allow_unfenced = true` is reloaded; then the job runs and each of
    its ports says `job.port_unfenced`."""
    config = short_tmp / "ddpd.toml"
    config.write_text('nft_library = "/nonexistent/libnftables.so.1"\n')
    async with running_daemon(short_tmp, "--config", str(config)) as d:
        unavailable = await d.wait_log(lambda e: e.get("event") == "fence.unavailable")
        assert "cannot load /nonexistent/libnftables.so.1" in unavailable["reason"], unavailable
        port = free_port("127.0.0.1")
        spec = d.spec(task="two-layer", nproc=1, steps=2, **multinode(port))
        with pytest.raises(RemoteError, match=re.escape("cannot load /nonexistent/libnftables.so.1")):
            await d.client.submit(spec)
        config.write_text(config.read_text() + "allow_unfenced = true\n")
        await d.client.reload()
        view = await d.run(spec)
        assert view.state == JobState.SUCCEEDED, view.root_cause
        unfenced = [e.data for e in await events_of(d, view.id) if e.kind == "job.port_unfenced"]
        assert sorted(u["port"] for u in unfenced) == sorted([port, view.store_port]), unfenced
    assert fence_rules(view.id) == []


@needs_nft
async def test_the_fence_api_fences_an_ipv6_address_and_a_wildcard_bind_as_bound(
    users: tuple[Identity, Identity],
) -> None:
    """Issue 34, finding 2, at the API with real nftables: [::1]:P is ann's and 127.0.0.1:P stays
    bob's; a wildcard IPv4 bind on Q fences Q on every local IPv4 address and not [::1]:Q."""
    ann, bob = users
    fences = Fences("ddpd-" + secrets.token_hex(6))
    assert await anyio.to_thread.run_sync(fences.open) == 0 and fences.unavailable == "", fences.unavailable
    held: list[socket.socket] = []
    try:
        p, q = free_port("::1", "127.0.0.1"), free_port("0.0.0.0", "::1")
        for host, port in (("::1", p), ("0.0.0.0", q)):
            held.append(tcp(host))
            held[-1].bind((host, port))
            await anyio.to_thread.run_sync(fences.install, host, port, ann.uid, f"api/{host}")
            held[-1].listen()
        async with service_of(bob, "127.0.0.1", p), service_of(bob, "::1", q):
            assert [await reaches(who, "::1", p) for who in (ann, bob)] == [True, False]
            assert await reaches(bob, "127.0.0.1", p)  # the same port on another address: bob's own
            for host in ("127.0.0.1", "127.0.0.2"):
                assert [await reaches(who, host, q) for who in (ann, bob)] == [True, False]
            assert await reaches(bob, "::1", q)  # the IPv4 wildcard's port on IPv6: bob's own
        assert len(fences.handles()) == 2
    finally:
        for sock in held:
            sock.close()
        await anyio.to_thread.run_sync(fences.close)
    assert fences.tag not in ruleset()
