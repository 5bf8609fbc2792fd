"""`ddpctl daemon` and the web view show the fork servers, against a real daemon with fork servers,
real torch and real users: each server's key, pid, state, Pss, spares, forks served and idle time;
the key and pid to its user and root, the counts only to another user.

Every wait is on a log line or a job's end, bounded with ``fail_after``; the daemon's stop proves no
rank is left, and each server and every worker it forked is proven gone afterwards.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from ddpd.client import JobSpec
from ddpd.daemon.contain.identity import Identity
from ddpd.protocol import JobState

from ..conftest import DaemonProc, assert_gone, running_daemon
from ..scripts.userpython import USER_PYTHON, user_pythonpath
from ..users import plain_env, submit_as
from .test_cli import DDPCTL
from .test_forkserver import SERVER_TIMEOUT, forked_pids
from .webserver import web_server

pytestmark = [pytest.mark.anyio, pytest.mark.xdist_group("users"),  # useradd/userdel lock /etc/passwd
              pytest.mark.skipif(os.geteuid() != 0, reason="running jobs as other users needs root")]

NPROC = 2
CLI_TIMEOUT = 60


def status_uid(pid: int) -> int:
    """The real uid /proc/PID/status gives the process (FileNotFoundError: it is gone)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise AssertionError(f"no Uid line for {pid}")


async def ddpctl_daemon(d: DaemonProc, who: Identity | None, *args: str) -> str:
    """`ddpctl daemon` as root (`who` None: the suite's own ddpctl) or as `who` (the interpreter and
    path other users can run); its stdout."""
    argv = [DDPCTL] if who is None else [USER_PYTHON, "-m", "ddpd.cli"]
    wide = {"COLUMNS": "400"}  # piped, Rich folds lines at 80 columns
    user: dict[str, Any] = {"env": {**os.environ, **wide}} if who is None else {
        "user": who.uid, "group": who.gid, "extra_groups": [], "env": plain_env(**wide), "cwd": "/"}
    with anyio.fail_after(CLI_TIMEOUT):
        done = await anyio.run_process([*argv, "--socket", str(d.socket), "daemon", *args], check=False,
                                       stdin=subprocess.DEVNULL, **user)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    return done.stdout.decode()


def servers_of(text: str) -> dict[int, dict[str, Any]]:
    """`ddpctl daemon -o json`'s servers by uid (one key per user here)."""
    found: dict[int, dict[str, Any]] = {}
    for s in json.loads(text)["pool_servers"]:
        assert s["uid"] not in found, text
        found[s["uid"]] = s
    return found


@pytest.mark.public_tmp(0o1777)
async def test_ddpctl_daemon_and_the_web_view_show_each_server_to_whom_it_may(
        users: tuple[Identity, Identity], public_tmp: Path) -> None:
    ann, bob = users
    config = public_tmp / "ddpd.toml"
    config.write_text('socket_mode = "0666"\npool_fork_server = true\n')
    async with running_daemon(public_tmp, "--config", str(config), "--gpus", "0", "--pool-size", "2",
                              "--cpu-slots", "4") as d:
        ready = await d.wait_log(lambda e: e.get("event") == "pool.worker_ready", SERVER_TIMEOUT)
        own = int(ready["pid"])  # the daemon's own key's server (root's), started with the daemon
        job = await d.run(d.spec(nproc=NPROC, steps=5, name="through-the-server"))
        assert job.state == JobState.SUCCEEDED, job.root_cause
        assert {r.pid for r in job.ranks} <= forked_pids(d), "the job's ranks were not forked"
        spec = JobSpec(task="two-layer", python=USER_PYTHON, nproc=NPROC, steps=2, workdir="/tmp",
                       environ={"PATH": "/usr/bin:/bin", "PYTHONPATH": user_pythonpath()})
        job_id = await submit_as(ann, d, spec)  # her key is new: it starts cold, her server beside it
        assert not job_id.startswith("refused"), job_id
        with anyio.fail_after(SERVER_TIMEOUT):
            assert (await d.client.wait(job_id)).state == JobState.SUCCEEDED
        hers = int((await d.wait_log(lambda e: e.get("event") == "pool.worker_ready" and e.get("uid") == ann.uid,
                                     SERVER_TIMEOUT))["pid"])

        # root sees every server in full
        seen = servers_of(await ddpctl_daemon(d, None, "-o", "json"))
        assert set(seen) == {0, ann.uid}, seen
        mine = seen[0]
        assert mine["pid"] == own and status_uid(own) == 0 and mine["state"] == "ready"
        assert mine["python"] == sys.executable and len(mine["env"]) == 12
        assert mine["pss"] is not None and mine["pss"] > 0, mine
        assert mine["forks"] >= NPROC and mine["user"] == "root" and mine["idle"] is not None
        assert seen[ann.uid]["pid"] == hers and status_uid(hers) == ann.uid
        assert seen[ann.uid]["python"] == USER_PYTHON and seen[ann.uid]["user"] == ann.name
        started = time.perf_counter()
        burst = [await d.client.daemon_info() for _ in range(20)]  # the Pss of a burst is read once per CACHE_TTL
        print("pool_view", {"daemon_info_ms": round((time.perf_counter() - started) * 1000 / 20, 2),
                            "servers": [(s.uid, s.state, s.pss, s.spares, s.forks) for s in burst[-1].pool_servers]})
        text = await ddpctl_daemon(d, None)
        line = next(line for line in text.splitlines() if line.startswith("fork server") and f"pid {own}," in line)
        assert f"root {sys.executable} env {mine['env']}: pid {own}, ready, Pss " in line, line
        assert "forks served" in line and "MiB" in line and "? MiB" not in line

        # her own server in full, root's counts only; to bob, hers and root's counts only
        as_ann = servers_of(await ddpctl_daemon(d, ann, "-o", "json"))
        assert as_ann[ann.uid]["python"] == USER_PYTHON and as_ann[ann.uid]["pid"] == hers
        assert (as_ann[0]["python"], as_ann[0]["env"], as_ann[0]["pid"]) == (None, None, None)
        assert as_ann[0]["forks"] >= NPROC and as_ann[0]["pss"] > 0
        as_bob = await ddpctl_daemon(d, bob, "-o", "json")
        assert USER_PYTHON not in as_bob and sys.executable not in as_bob and str(hers) not in as_bob
        assert all(s["python"] is None and s["pid"] is None and s["env"] is None for s in servers_of(as_bob).values())
        bob_text = await ddpctl_daemon(d, bob)
        assert f"fork server  {ann.name}: ready, Pss " in bob_text and USER_PYTHON not in bob_text, bob_text

        # the web view: the JSON its daemon page fetches and the page's table, as root and as bob
        async with web_server(d.socket) as web, httpx.AsyncClient(timeout=30) as http:
            api = (await http.get(web.at("/api/daemon"))).json()["daemon"]
            assert {s["uid"]: s["pid"] for s in api["pool_servers"]} == {0: own, ann.uid: hers}
            page = (await http.get(web.at("/daemon"))).text
            assert "<h2>fork servers</h2>" in page and f">{own}<" in page and USER_PYTHON in page
        async with web_server(d.socket, uid=bob.uid) as web, httpx.AsyncClient(timeout=30) as http:
            api_text = (await http.get(web.at("/api/daemon"))).text
            assert USER_PYTHON not in api_text and sys.executable not in api_text and len(
                json.loads(api_text)["daemon"]["pool_servers"]) == 2
            page = (await http.get(web.at("/daemon"))).text
            assert "<h2>fork servers</h2>" in page and f"<td>{ann.name}</td>" in page and USER_PYTHON not in page
    for pid in {own, hers, *forked_pids(d)}:  # the servers and every worker they forked
        assert_gone(pid)
