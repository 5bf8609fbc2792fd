"""Jobs run as the people who submit them, in their own environment (real daemon, real users).

Run as root: two users are created for the module (useradd) and removed afterwards. They submit
with ddpctl over the real socket (0666 for the test), with an interpreter they can run: the
system's python with this checkout and the venv's packages on PYTHONPATH, as a user would export
in their shell (tests/scripts/userpython.py), through a wrapper that marks its own use.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from ddpd.client import AsyncClient, JobSpec, RemoteError
from ddpd.daemon.contain.identity import Identity

from ..conftest import REPO, DaemonProc, assert_gone, running_daemon
from ..scripts.userpython import USER_PYTHON, user_env
from .test_pool import forking

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.xdist_group("users"),  # useradd/userdel lock /etc/passwd: one worker at a time
    pytest.mark.skipif(os.geteuid() != 0, reason="running jobs as other users needs root"),
]

SHOW = str(REPO / "tests" / "scripts" / "show_identity.py")
TIMEOUT = 180


@asynccontextmanager
async def shared_daemon(base: Path, *flags: str, config_text: str = "") -> AsyncIterator[DaemonProc]:
    """A root daemon whose socket everyone may use, with a variable of its own in its environment."""
    config = base / "ddpd.toml"
    config.write_text('socket_mode = "0666"\n' + config_text)
    async with running_daemon(base, "--config", str(config), "--gpus", "0", *flags,
                              env={"DAEMON_SETTING": "daemon"}) as d:
        yield d


def wrapper(base: Path) -> str:
    """An interpreter the users can run that marks that it was the one used."""
    path = base / "python-wrapper"
    path.write_text(f'#!/bin/sh\nexport PYTHON_WRAPPER="{path}"\nexec {USER_PYTHON} "$@"\n')
    path.chmod(0o755)
    return str(path)


async def as_user(who: Identity, d: DaemonProc, *args: str, **env: str) -> subprocess.CompletedProcess[bytes]:
    """ddpctl run as `who` (tests/scripts/as_user.py), from a shell that exported PYTHONPATH and `env`."""
    argv = [sys.executable, "-m", "tests.scripts.as_user", str(who.uid), str(who.gid), "--",
            "--socket", str(d.socket), *args]
    with anyio.fail_after(TIMEOUT):
        return await anyio.run_process(argv, check=False, stdin=subprocess.DEVNULL, cwd=str(REPO),
                                       env=user_env(HOME="/tmp", COLUMNS="200", **env))


async def ddpctl_submit_as(who: Identity, d: DaemonProc, *args: str, **env: str) -> str:
    """`ddpctl submit ARGS` run as `who`: the job id it printed."""
    done = await as_user(who, d, "submit", *args, **env)
    assert done.returncode == 0, done.stderr.decode()
    return done.stdout.decode().strip()


def reports(text: str) -> list[dict[str, Any]]:
    return [json.loads(line.split(" ", 1)[1]) for line in text.splitlines() if line.startswith("ddpd-test-identity ")]


async def test_ranks_run_as_the_submitter_in_their_environment(
    users: tuple[Identity, Identity], public_tmp: Path
) -> None:
    ann, bob = users
    python = wrapper(public_tmp)
    async with shared_daemon(public_tmp) as d:
        umask = os.umask(0o027)  # ddpctl sends its shell's umask: the ranks run with it
        try:
            job_id = await ddpctl_submit_as(ann, d, "--nproc", "2", "--python", python, "--env", "EXTRA_SETTING=pair",
                                     "--", SHOW, MY_SETTING="hello")
        finally:
            os.umask(umask)
        with anyio.fail_after(TIMEOUT):
            view = await d.client.wait(job_id)
        assert view.state == "SUCCEEDED", view.root_cause
        assert view.owner_uid == ann.uid
        done = await as_user(ann, d, "logs", job_id, "--no-prefix")  # the owner reads their logs
        assert done.returncode == 0, done.stderr.decode()
        seen = reports(done.stdout.decode())
        assert len(seen) == 2, done.stdout.decode()
        for rank in seen:
            assert (rank["uid"], rank["euid"], rank["gid"]) == (ann.uid, ann.uid, ann.gid)
            assert rank["groups"] == sorted(ann.groups)
            assert rank["umask"] == 0o027
            assert rank["env"] == {"HOME": ann.home, "USER": ann.name, "LOGNAME": ann.name, "SHELL": ann.shell,
                                   "MY_SETTING": "hello", "DAEMON_SETTING": None,
                                   "PYTHON_WRAPPER": python, "EXTRA_SETTING": "pair"}
            assert rank["executable"] == USER_PYTHON  # what the wrapper exec'd
            assert rank["cwd"] == "/"  # ddpctl's working directory (as_user runs it in /)
        # the files are the submitter's, in a tree no one else can read
        user_dir = d.state_dir / "users" / str(ann.uid)
        st = user_dir.stat()
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (ann.uid, 0o700)
        for r in view.ranks:
            assert r.log is not None and Path(r.log).is_relative_to(user_dir)
            st = os.stat(r.log)
            assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (ann.uid, 0o600)
        ckpt = user_dir / "jobs" / job_id / "checkpoints"
        assert ckpt.stat().st_uid == ann.uid
        assert stat.S_IMODE(d.state_dir.stat().st_mode) == 0o711
        peek = await anyio.run_process(["cat", str(view.ranks[0].log)], user=bob.uid, group=bob.gid,
                                       extra_groups=[], check=False)
        assert peek.returncode != 0 and b"Permission denied" in peek.stderr
        # no environment value in the journal
        events = [e async for e in d.client.events(job_id)]
        assert events and not any("hello" in json.dumps(e.data) or "pair" in json.dumps(e.data) for e in events)


async def test_an_interpreter_without_ddpd_is_refused_at_submit(
    users: tuple[Identity, Identity], public_tmp: Path
) -> None:
    ann, _ = users
    async with shared_daemon(public_tmp) as d:
        # the same python without the exported PYTHONPATH lacks torch and ddpd
        done = await as_user(ann, d, "submit", "--python", USER_PYTHON, "--export", "NONE", "--", SHOW)
        err = done.stderr.decode()
        assert done.returncode != 0
        assert "bad_spec" in err and "python:" in err and "No module named" in err, err
        assert "pip install" in err
        done = await as_user(ann, d, "submit", "--python", str(public_tmp / "missing"), "--", SHOW)
        assert done.returncode != 0 and "does not exist" in done.stderr.decode()
        assert await d.client.list_jobs() == []


async def test_other_users_see_that_a_job_exists_and_nothing_more(
    users: tuple[Identity, Identity], public_tmp: Path
) -> None:
    ann, bob = users
    async with shared_daemon(public_tmp) as d:
        job_id = await ddpctl_submit_as(ann, d, "--name", "ann-secret-name", "--python", USER_PYTHON,
                                 "--env", "EXTRA_SETTING=ann-token", "--", SHOW, "--secret-arg",
                                 MY_SETTING="exported-token")
        with anyio.fail_after(TIMEOUT):
            assert (await d.client.wait(job_id)).state == "SUCCEEDED"
        # bob sees the job in ls and status: id, owner, state, resources; no name, spec text or ranks
        done = await as_user(bob, d, "ls", "-o", "json")
        assert done.returncode == 0, done.stderr.decode()
        (listed,) = [j for j in json.loads(done.stdout) if j["id"] == job_id]
        done = await as_user(bob, d, "status", job_id, "-o", "json")
        assert done.returncode == 0, done.stderr.decode()
        for view in (listed, json.loads(done.stdout)):
            assert (view["owner_uid"], view["state"], view["spec"].get("nproc", 1)) == (ann.uid, "SUCCEEDED", 1)
            assert view["name"] == "" and view["ranks"] == [] and view["spec"].get("script") is None
            text = json.dumps(view)
            assert "secret" not in text and "token" not in text and "show_identity" not in text
        # nor its logs or events
        for op in ("logs", "events"):
            done = await as_user(bob, d, op, job_id)
            assert done.returncode != 0 and "permission_denied" in done.stderr.decode(), (op, done.stderr.decode())
        done = await as_user(bob, d, "events", "-o", "json")
        assert done.returncode == 0, done.stderr.decode()
        assert job_id not in done.stdout.decode()
        # ann sees her job whole, with no environment values in any view
        done = await as_user(ann, d, "status", job_id, "-o", "json")
        mine = json.loads(done.stdout)
        assert mine["name"] == "ann-secret-name" and mine["spec"]["script"] == [SHOW, "--secret-arg"]
        assert mine["spec"]["env"] == {"EXTRA_SETTING": "ann-token"} and mine["spec"].get("environ") is None
        assert mine["spec"]["export"] == "ALL" and "exported-token" not in done.stdout.decode()
        done = await as_user(ann, d, "events", "-o", "json")
        assert job_id in done.stdout.decode() and "exported-token" not in done.stdout.decode()
        assert (await d.client.status(job_id)).name == "ann-secret-name"  # root sees it all


def as_cold_start(report: dict[str, Any], job_id: str) -> dict[str, Any]:
    """What a rank reported, less what differs from one job to the next (its ids, port and pid)."""
    same = {k: v for k, v in report.items() if k != "pid"}
    same["environ"] = {k: v for k, v in report["environ"].items() if job_id not in v and k != "MASTER_PORT"}
    same["cgroup"] = report["cgroup"].replace(job_id, "JOB")
    return same


async def test_the_pool_keeps_a_users_shape_warm_and_serves_no_one_else(
    users: tuple[Identity, Identity], public_tmp: Path
) -> None:
    """A job of a (user, interpreter, environment) leaves that shape warm: an interpreter started as
    that user (a fork server, the default; or a whole interpreter). Another user's job of the same
    interpreter runs cold, and the next job of the shape runs pooled (forked by that server, or on
    that interpreter), which is then the cold start it stands in for: the same uid, groups, umask,
    environment, interpreter, working directory and cgroup."""
    ann, bob = users
    # pool_server_wait 0: a key's first job starts cold beside its server (the cold start to compare with)
    config = "pool_per_key = 1\npool_server_wait = 0\n"
    async with shared_daemon(public_tmp, "--pool-size", "2", config_text=config) as d:
        runs: list[tuple[str, dict[str, Any], list[Any]]] = []
        for who in (ann, bob, ann):
            job_id = await ddpctl_submit_as(who, d, "--python", USER_PYTHON, "--", SHOW, MY_SETTING="hello")
            with anyio.fail_after(TIMEOUT):
                view = await d.client.wait(job_id)
            assert view.state == "SUCCEEDED", view.root_cause
            done = await as_user(who, d, "logs", job_id, "--no-prefix")
            [seen] = reports(done.stdout.decode())
            spawned = [e for e in [e async for e in d.client.events(job_id)] if e.kind == "rank.spawned"]
            runs.append((job_id, seen, [e.data.get("pooled") for e in spawned]))
            if len(runs) == 1:  # the pool learned ann's shape: an interpreter of hers, started as her
                ready = await d.wait_log(lambda e: e.get("event") == "pool.worker_ready" and e.get("uid") == ann.uid,
                                         TIMEOUT)
                pooled = int(ready["pid"])
                assert os.stat(f"/proc/{pooled}").st_uid == ann.uid
        # two in all: the keys used last (ann's, bob's) took the room of the daemon's own key
        retired = await d.wait_log(lambda e: e.get("event") == "pool.worker_retired", TIMEOUT)
        assert retired["uid"] == os.geteuid()
        (cold_id, cold, cold_pooled), (_, bobs, bob_pooled), (warm_id, warm, warm_pooled) = runs
        assert cold_pooled == [None] and bob_pooled == [None] and bobs["uid"] == bob.uid
        assert warm_pooled == [True]
        if forking(d):  # the rank was forked by ann's server
            assert warm["pid"] in {e.get("pid") for e in d.logs if e.get("event") == "pool.forked"
                                   and e.get("server") == pooled}, (warm["pid"], pooled)
        else:
            assert warm["pid"] == pooled
        warm_env, cold_env = as_cold_start(warm, warm_id)["environ"], as_cold_start(cold, cold_id)["environ"]
        assert warm_env == cold_env, {k: (warm_env.get(k), cold_env.get(k)) for k in {*warm_env, *cold_env}
                                      if warm_env.get(k) != cold_env.get(k)}
        assert as_cold_start(warm, warm_id) == as_cold_start(cold, cold_id)
        assert warm["uid"] == ann.uid and warm["env"]["MY_SETTING"] == "hello" and warm["env"]["DAEMON_SETTING"] is None


async def test_a_per_user_daemon_serves_its_own_user_only(
    users: tuple[Identity, Identity], public_tmp: Path
) -> None:
    """A daemon that is not root cannot switch users: it runs its user's jobs as that user and
    tells anyone else (root included) that it serves that user only."""
    ann, bob = users
    home = public_tmp / "ann"
    home.mkdir()
    os.chown(home, ann.uid, ann.gid)
    config = home / "ddpd.toml"
    config.write_text('socket_mode = "0666"\n')
    os.chown(config, ann.uid, ann.gid)
    sock, state = home / "ddpd.sock", home / "state"
    argv = [USER_PYTHON, "-m", "ddpd.daemon", "serve", "--socket", str(sock), "--state-dir", str(state),
            "--config", str(config), "--log-format", "json", "--gpus", "0", "--pool-size", "0"]
    async with anyio.create_task_group() as tg:
        proc = await anyio.open_process(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, cwd=str(home),
                                        env=user_env(HOME=str(home)), user=ann.uid, group=ann.gid,
                                        extra_groups=list(ann.groups))
        d = DaemonProc(socket=sock, state_dir=state, proc=proc, client=AsyncClient(sock))
        tg.start_soon(d._pump)
        try:
            await d.wait_log(lambda e: e.get("event") == "daemon.ready", 60)
            assert any(e.get("event") == "cgroup.unavailable" for e in d.logs)  # not root: no cgroup of its own here
            done = await as_user(bob, d, "ping")
            assert done.returncode != 0
            err = done.stderr.decode()
            assert "permission_denied" in err and f"runs as uid {ann.uid} and serves that user only" in err, err
            with pytest.raises(RemoteError) as refused:
                await d.client.submit(JobSpec(task="two-layer"))
            assert refused.value.code == "permission_denied"
            job_id = await ddpctl_submit_as(ann, d, "--python", USER_PYTHON, "--", SHOW)
            done = await as_user(ann, d, "wait", job_id, "-o", "json")
            assert json.loads(done.stdout)["state"] == "SUCCEEDED", done.stdout.decode()
            done = await as_user(ann, d, "logs", job_id, "--no-prefix")
            (seen,) = reports(done.stdout.decode())
            assert (seen["uid"], seen["gid"], seen["env"]["HOME"]) == (ann.uid, ann.gid, ann.home)
            done = await as_user(ann, d, "status", job_id, "-o", "json")
            pids = [r["pid"] for r in json.loads(done.stdout)["ranks"]]
        finally:
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
            with anyio.fail_after(60):
                assert await proc.wait() == 0
            tg.cancel_scope.cancel()
    for pid in pids:
        assert_gone(pid)


OLD_CLIENT = """
import sys
from ddpd.client import Client, JobSpec, RemoteError
try:
    Client(sys.argv[1]).submit(JobSpec(task="two-layer", steps=1))
except RemoteError as exc:
    print(exc.code, exc.message)
"""


async def test_an_older_client_of_another_user_is_refused_when_the_daemons_interpreter_is_closed_to_them(
    users: tuple[Identity, Identity], public_tmp: Path
) -> None:
    """A client that sends no interpreter gets the daemon's; as another user, that one is checked at submit."""
    ann, _ = users
    async with shared_daemon(public_tmp) as d:
        done = await anyio.run_process([USER_PYTHON, "-c", OLD_CLIENT, str(d.socket)], check=False,
                                       user=ann.uid, group=ann.gid, extra_groups=[], cwd="/",
                                       env=user_env(HOME="/tmp"))
        out = done.stdout.decode()
        if not out:  # the daemon's interpreter is open to every user here: the job was accepted
            pytest.skip(f"the daemon's interpreter ({sys.executable}) is reachable by {ann.name} here")
        assert out.startswith("bad_spec python: python ") and "is not executable by user" in out, out
