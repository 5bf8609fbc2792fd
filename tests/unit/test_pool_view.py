"""What `ddpctl daemon` and the web view show of the fork servers: the Pss read from /proc (a gone
pid counts 0), its cache, the view a viewer gets (the key and pid for those who see its user's
detail, the counts for anyone), the text and the web table, and the protocol across versions (a
daemon or client older than the servers' field)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import anyio
import msgspec
import pytest
from rich.console import Console

from ddpd.cli.daemon_view import daemon_grid, server_line
from ddpd.cli.web.data import DaemonPage
from ddpd.cli.web.present import daemon_context, environment
from ddpd.client import DaemonInfo, PoolServerView
from ddpd.daemon.control.poolview import PssCache, env_digest, pss_of, server_view
from ddpd.daemon.pool.members import ServerSnapshot
from ddpd.daemon.pool.poolkeys import PoolKey

MIB = 1 << 20
KEY = PoolKey.of(1000, sys.executable, {"HOME": "/home/ann", "PYTHONPATH": "/secret/path", "LANG": "C.UTF-8"})


def gone_pid() -> int:
    """The pid of a process that has ended and been reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"], stdin=subprocess.DEVNULL)
    proc.wait(timeout=60)
    return proc.pid


def test_pss_is_read_from_smaps_rollup_and_a_gone_pid_counts_zero() -> None:
    own = pss_of(os.getpid())
    assert own is not None and own > 10 * MIB  # this interpreter, with pytest and msgspec imported
    assert pss_of(gone_pid()) == 0


@pytest.mark.anyio
async def test_the_cache_reads_each_pid_once_per_ttl_off_the_loop() -> None:
    cache = PssCache(ttl=60.0, deadline=30.0)
    gone = gone_pid()
    first = await cache.get([os.getpid(), gone])
    assert first[gone] == 0 and (first[os.getpid()] or 0) > 10 * MIB
    read_at = cache._values[os.getpid()][1]
    again = await cache.get([os.getpid()])
    assert again == {os.getpid(): first[os.getpid()]} and cache._values[os.getpid()][1] == read_at  # not read again
    stale = PssCache(ttl=0.0, deadline=30.0)
    await stale.get([os.getpid()])
    before = stale._values[os.getpid()][1]
    got = await stale.get([os.getpid()])
    assert stale._values[os.getpid()][1] > before and got[os.getpid()] is None  # read again; at ttl 0 never shown


@pytest.mark.anyio
async def test_a_read_past_the_deadline_answers_unknown_and_the_next_round_reads() -> None:
    """A request never waits on /proc longer than its deadline (a process holding its mmap lock would
    stall the read): what was not read by then is unknown. Bug: a round cut short before its thread
    started (here at once: a deadline of 0) stayed in flight for good, and every later read was
    unknown."""
    cache = PssCache(ttl=60.0, deadline=0.0)
    with anyio.fail_after(5):
        assert await cache.get([os.getpid()]) == {os.getpid(): None}
        assert await cache.get([os.getpid()]) == {os.getpid(): None}
    cache.deadline = 30.0
    with anyio.fail_after(30):
        got = await cache.get([os.getpid()])
    assert (got[os.getpid()] or 0) > 10 * MIB


def test_a_viewer_without_detail_sees_the_counts_and_not_the_key() -> None:
    snap = ServerSnapshot(KEY, "/home/ann/venv/bin/python", 4242, True, 12, (4243, 4244), time.monotonic() - 90)
    pss = {4242: 40 * MIB, 4243: 110 * MIB, 4244: 0}
    full = server_view(snap, pss, "ann", True, time.monotonic())
    assert (full.pid, full.python, full.env) == (4242, "/home/ann/venv/bin/python", env_digest(KEY))
    assert full.state == "ready"
    assert (full.pss, full.forks, full.spares, full.user, full.uid) == (150 * MIB, 12, 2, "ann", 1000)
    assert full.idle is not None and 89 <= full.idle < 120
    hidden = server_view(snap, pss, "ann", False, time.monotonic())
    assert (hidden.pid, hidden.python, hidden.env) == (None, None, None)
    assert (hidden.pss, hidden.forks, hidden.spares, hidden.state) == (150 * MIB, 12, 2, "ready")
    assert "/home/ann" not in msgspec.json.encode(hidden).decode() and "secret" not in str(hidden)
    unknown = server_view(snap, {**pss, 4243: None}, None, True, time.monotonic())
    assert unknown.pss is None  # one part not read in time: the whole is unknown, never a partial sum
    starting = server_view(ServerSnapshot(KEY, "py", 7, False, 0, (), None), {7: MIB}, None, True, 0.0)
    assert (starting.state, starting.idle, starting.spares) == ("starting", None, 0)


def test_the_env_digest_is_short_stable_and_tells_keys_apart() -> None:
    other = PoolKey.of(1000, sys.executable, {"HOME": "/home/ann", "PYTHONPATH": "/other"})
    assert len(env_digest(KEY)) == 12 and int(env_digest(KEY), 16) >= 0
    assert env_digest(KEY) == env_digest(PoolKey.of(1000, sys.executable, dict(KEY.startup)))
    assert env_digest(other) != env_digest(KEY)


SERVERS = [PoolServerView(uid=1000, state="ready", user="ann", pid=4242, python="/home/ann/venv/bin/python",
                          env="3fa2c1d4e5f6", pss=150 * MIB, forks=12, spares=2, idle=95.0),
           PoolServerView(uid=1001, state="starting", user="bob", pss=None, forks=0, spares=0, idle=None)]


def info(servers: list[PoolServerView]) -> DaemonInfo:
    return DaemonInfo(version="1", protocol=1, pid=1, uptime=1.0, socket="s", state_dir="d", running=0, queued=0,
                      cpu_slots=2, gpus=0, pool_state="warm (2 fork servers ready, 2 forked, 12 forks served)",
                      pool_servers=servers)


def test_ddpctl_daemon_shows_one_line_per_server() -> None:
    ann, bob = SERVERS
    assert server_line(ann) == ("ann /home/ann/venv/bin/python env 3fa2c1d4e5f6: pid 4242, ready, Pss 150 MiB, "
                                "2 spares, 12 forks served, idle 1m35s")
    assert server_line(bob) == "bob: starting, Pss ? MiB, 0 spares, 0 forks served"
    console = Console(width=200, record=True)
    console.print(daemon_grid(info(SERVERS)))
    text = console.export_text()
    rows = [line.split(None, 2)[2].rstrip() for line in text.splitlines() if line.startswith("fork server ")]
    assert rows == [server_line(ann), server_line(bob)]


def test_the_web_page_shows_the_servers_table() -> None:
    page = DaemonPage(info(SERVERS), (0.5, 0.5, 0.5), 2)
    html = environment().get_template("_daemon.html").render(**daemon_context(page))
    assert "<h2>fork servers</h2>" in html and "ann /home/ann/venv/bin/python env 3fa2c1d4e5f6" in html
    assert ">4242<" in html and ">150 MiB<" in html and ">12<" in html and "1m35s" in html
    assert "<td>bob</td>" in html and ">?<" in html
    none = environment().get_template("_daemon.html").render(**daemon_context(DaemonPage(info([]), (0, 0, 0), 2)))
    assert "<h2>fork servers</h2>" not in none


class OlderDaemonInfo(msgspec.Struct):
    """DaemonInfo as a daemon or client before the fork servers' field had it (its required fields)."""

    version: str
    protocol: int
    pid: int
    uptime: float
    socket: str
    state_dir: str
    running: int
    queued: int
    cpu_slots: int
    gpus: int
    pool_state: str | None = None


def test_the_servers_field_crosses_versions() -> None:
    new = msgspec.json.encode(info(SERVERS))
    assert msgspec.json.decode(new, type=DaemonInfo).pool_servers == SERVERS  # round trip
    older_client = msgspec.json.decode(new, type=OlderDaemonInfo)  # an older client ignores the field
    assert older_client.pool_state == info(SERVERS).pool_state
    from_older = msgspec.json.decode(msgspec.json.encode(older_client), type=DaemonInfo)  # an older daemon's answer
    assert from_older.pool_servers == []
    hidden = msgspec.to_builtins(SERVERS[1])
    assert set(hidden) == set(PoolServerView.__struct_fields__)  # every field in the JSON, None included
