"""A root daemon serving two unprivileged users (useradd), each hostile in turn.

Each test is one of the ways a local user or a job of theirs reached past its share of a shared
box: descriptors exhausted at the door, connections hoarded (idle, or `wait`s of a client that then
vanished), a rotation redirected through a swapped directory, orphans piling up as zombies, ranks
given the daemon's environment, a rank growing the database (a user's hostile interpreter:
`test_hostile_wrappers`). Each asserts that the daemon stays up and
answers the other user (and root) within a bound, that the attacked job is unaffected where the
fix says so, and that nothing is left: no process, no zombie of the daemon, no cgroup.

The users' own code runs on the system's python with this checkout on its path
(`users.user_python_for_tests`); the door clients below need only its standard library.
"""

from __future__ import annotations

import json
import os
import resource
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream

from ddpd.daemon.contain.identity import SANE_PATH, Identity
from ddpd.daemon.contain.usertree import ensure_dirs
from ddpd.protocol import JobSpec, JobState

from ..conftest import REPO, DaemonProc, running_daemon
from ..rawclient import ping_within
from ..scripts.helpers import gated, wait_waiting_at_gate
from ..scripts.userpython import USER_PYTHON, user_pythonpath
from ..users import plain_env, submit_as

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.xdist_group("users"),  # useradd/userdel lock /etc/passwd: one worker at a time
    pytest.mark.skipif(os.geteuid() != 0, reason="a shared box needs a root daemon and real users"),
]

TIMEOUT = 180
PING_BOUND = 5.0  # seconds within which every other user's ping is answered

# a user's client of the door (standard library only): N connections, each admitted (its ping
# answered) or refused (limit_exceeded at once); with `wait`, each admitted one then waits on JOB.
# Prints what it saw as one JSON line and holds its connections until its stdin closes.
DOOR = r"""
import json, socket, sys
path, n, op = sys.argv[1], int(sys.argv[2]), sys.argv[3]
job = sys.argv[4] if len(sys.argv) > 4 else ""
held, seen = [], {"ok": 0, "refused": 0, "messages": []}
for _ in range(n):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(60)
    s.connect(path)
    try:
        s.sendall(b'{"op":"ping","id":1}\n')
    except OSError:
        pass  # refused and closed already: its answer is still there to read
    try:
        line = s.makefile("rb").readline()
    except OSError as exc:
        line = json.dumps({"type": "error", "message": str(exc)}).encode()
    reply = json.loads(line) if line else {"type": "error", "message": "closed"}
    if reply.get("type") == "ok":
        seen["ok"] += 1
        if op == "wait":
            s.sendall(json.dumps({"op": "wait", "id": 2, "job_id": job}).encode() + b"\n")
        held.append(s)
    else:
        seen["refused"] += 1
        seen["messages"].append(reply.get("message", ""))
        s.close()
print(json.dumps(seen), flush=True)
sys.stdin.read()
"""

@asynccontextmanager
async def shared_box(base: Path, config_text: str = "", *flags: str) -> AsyncIterator[DaemonProc]:
    """A root daemon whose socket everyone may use, with a secret of its own in its environment."""
    config = base / "ddpd.toml"
    config.write_text('socket_mode = "0666"\n' + config_text)
    async with running_daemon(base, "--config", str(config), "--gpus", "0", *flags,
                              env={"DAEMON_SECRET": "root-only"}) as d:
        yield d
        assert daemon_zombies(d.proc.pid) == []


@asynccontextmanager
async def door(who: Identity, d: DaemonProc, n: int, op: str = "ping", job: str = "") -> AsyncIterator[dict[str, Any]]:
    """`who` holds `n` connections (DOOR above) for the block; what it saw."""
    proc = await anyio.open_process([USER_PYTHON, "-c", DOOR, str(d.socket), str(n), op, job], user=who.uid,
                                    group=who.gid, extra_groups=[], cwd="/", env={"PATH": "/usr/bin:/bin"})
    try:
        assert proc.stdout is not None
        with anyio.fail_after(60):
            line = await BufferedByteReceiveStream(proc.stdout).receive_until(b"\n", 1 << 20)
        yield json.loads(line)
    finally:
        with anyio.CancelScope(shield=True):
            assert proc.stdin is not None
            await proc.stdin.aclose()
            with anyio.move_on_after(10):
                await proc.wait()
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


async def pings(who: Identity, d: DaemonProc) -> None:
    """`who` is answered (one connection, one ping) within PING_BOUND."""
    with anyio.fail_after(PING_BOUND):
        async with door(who, d, 1) as seen:
            assert seen["ok"] == 1, seen


def script_spec(*argv: str, **kw: Any) -> JobSpec:
    kw.setdefault("environ", plain_env())
    kw.setdefault("python", USER_PYTHON)
    return JobSpec(script=list(argv), nproc=1, workdir="/tmp", **kw)


async def eventually(predicate: Callable[[], bool], timeout: float) -> None:
    """A state only /proc shows (no event to wait on), looked at every 50 ms, within `timeout`."""
    with anyio.fail_after(timeout):
        while True:
            if predicate():
                return
            await anyio.sleep(0.05)


def daemon_zombies(pid: int) -> list[int]:
    """The daemon's children that are zombies (none once it reaped what it inherited)."""
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            kids = Path(f"/proc/{pid}/task/{task}/children").read_text().split()
        except OSError:
            continue
        for kid in kids:
            try:
                if Path(f"/proc/{kid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                    found.append(int(kid))
            except OSError:
                continue
    return found


def processes_with(text: str) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        try:
            if name.isdigit() and text.encode() in Path(f"/proc/{name}/cmdline").read_bytes().replace(b"\0", b" "):
                found.append(int(name))
        except OSError:
            continue
    return found


async def test_running_out_of_descriptors_pauses_accepting_and_ends_nothing(
    users: tuple[Identity, Identity], public_tmp: Path
) -> None:
    """Bug: accept() raised EMFILE out of the listener, which ended the root task group: the daemon
    exited, and every job with it."""
    _, bob = users
    async with shared_box(public_tmp) as d:
        pid = d.proc.pid
        soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (len(os.listdir(f"/proc/{pid}/fd")) + 3, hard))
        held = []
        try:
            for _ in range(12):  # more than the daemon can accept: the rest wait in the backlog
                sock = socket.socket(socket.AF_UNIX)
                sock.connect(str(d.socket))
                held.append(sock)
            failed = await d.wait_log(lambda e: e.get("event") == "listener.accept_failed")
            assert failed["listener"] == "control" and failed["errno"] == "EMFILE", failed
        finally:
            for sock in held:
                sock.close()
        await ping_within(d.client, PING_BOUND)  # the door opens again once descriptors are back
        await d.wait_log(lambda e: e.get("event") == "listener.accept_resumed")
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
        await pings(bob, d)
        assert d.proc.returncode is None


async def test_one_user_cannot_lock_out_the_others_and_a_vanished_waiter_frees_its_slots(
    users: tuple[Identity, Identity], public_tmp: Path
) -> None:
    """Bug: 256 idle connections, or 256 `wait`s of a client that then exited, of one user took the
    whole max_connections until the waited job ended: root could neither ping nor cancel."""
    ann, bob = users
    gate = public_tmp / "gate"
    async with shared_box(public_tmp, "max_connections = 16\nmax_connections_per_user = 4\n") as d:
        job_id = await d.client.submit(gated(d, gate, name="root's"))
        await wait_waiting_at_gate(d, job_id)
        async with door(ann, d, 10, "wait", job_id) as seen:
            assert seen["ok"] == 4 and seen["refused"] == 6, seen
            assert all("max_connections_per_user = 4" in m for m in seen["messages"]), seen
            await pings(bob, d)
            await ping_within(d.client, PING_BOUND)
        # her client is gone: its four waits end now, though the job they waited on runs on
        with anyio.fail_after(30):
            while True:
                async with door(ann, d, 4) as again:
                    if again["ok"] == 4:
                        break
                await anyio.sleep(0.1)
        assert (await d.client.status(job_id)).state == JobState.RUNNING
        gate.touch()
        with anyio.fail_after(TIMEOUT):
            assert (await d.client.wait(job_id)).state == JobState.SUCCEEDED


ROTATE = r"""
import os, sys, time
log = os.readlink("/proc/self/fd/1")
attempt = os.path.dirname(log)
os.rename(attempt, attempt + ".moved")  # fd 1 stays the log, now under the moved directory
os.symlink(sys.argv[1], attempt)  # what the daemon thinks is the attempt: the victim's
print("SWAPPED", flush=True)
line = b"x" * 1023 + b"\n"
for _ in range(256):
    os.write(1, line)  # 256 KiB, past the job's 64 KiB --log-max
time.sleep(600)
"""


async def test_rotation_never_follows_a_swapped_directory_into_another_users_tree(
    users: tuple[Identity, Identity], public_tmp: Path
) -> None:
    """Bug: a rank swapped its job directory for a symlink into another user's job tree and wrote past
    --log-max; rotation built the backup path from strings, so root unlinked the victim's
    rank-0.log.1 and created a forged one, owned by the attacker, in the victim's 0700 directory."""
    ann, bob = users
    script = public_tmp / "rotate.py"
    script.write_text(ROTATE)
    async with shared_box(public_tmp) as d:
        victim = ensure_dirs(d.state_dir, bob, "jobs", "victim", "attempt-1")
        backup = victim / "rank-0.log.1"
        backup.write_text("bob's own rotated log\n")
        os.chown(backup, bob.uid, bob.gid)
        before = {p.name: (p.stat().st_ino, p.stat().st_uid, p.read_bytes()) for p in victim.iterdir()}
        job_id = await submit_as(ann, d, script_spec(str(script), str(victim), log_max=64 * 1024))
        failed = await d.wait_log(lambda e: e.get("event") == "rank.log_rotation_failed"
                                  and e.get("job_id") == job_id, timeout=TIMEOUT)
        assert "symlink" in failed["error"], failed
        after = {p.name: (p.stat().st_ino, p.stat().st_uid, p.read_bytes()) for p in victim.iterdir()}
        assert after == before
        await pings(bob, d)
        await d.client.cancel(job_id)
        with anyio.fail_after(TIMEOUT):
            assert (await d.client.wait(job_id)).state == JobState.CANCELLED


async def test_orphans_of_a_job_are_reaped(users: tuple[Identity, Identity], public_tmp: Path) -> None:
    """Bug: as a child subreaper the daemon reaped only pids it knew; a job whose 200 grandchildren
    were orphaned left 201 zombies after it ended."""
    _, bob = users
    async with shared_box(public_tmp) as d:
        view = await d.run(d.spec(task="tests.adversarial.box_tasks:orphan_children", nproc=1, steps=3,
                                  options={"count": 100}))
        assert view.state == JobState.SUCCEEDED, view.root_cause
        # the orphans' `sleep 0.2` end, each a SIGCHLD the reaper answers
        await eventually(lambda: not daemon_zombies(d.proc.pid), 30)
        await pings(bob, d)


async def test_a_submit_without_environ_gets_the_passwd_entry_never_the_daemons(
    users: tuple[Identity, Identity], public_tmp: Path
) -> None:
    """Bug: a submit without `environ` gave the user's ranks the root daemon's environment (HOME=/root,
    root's PATH, a secret set in the daemon's environment)."""
    ann, _ = users
    async with shared_box(public_tmp) as d:
        spec = script_spec(str(REPO / "tests" / "scripts" / "show_env.py"), environ=None,
                           env={"PYTHONPATH": user_pythonpath()})
        job_id = await submit_as(ann, d, spec)
        with anyio.fail_after(TIMEOUT):
            view = await d.client.wait(job_id)
        assert view.state == JobState.SUCCEEDED, view.root_cause
        text = ""
        async with d.client.logs(job_id) as chunks:
            async for chunk in chunks:
                text += chunk.text
        line = next(ln for ln in text.splitlines() if ln.startswith("ddpd-test-env "))
        env = json.loads(line.split(" ", 1)[1])["env"]
        assert (env["HOME"], env["USER"], env["LOGNAME"], env["SHELL"]) == (ann.home, ann.name, ann.name, ann.shell)
        assert env["PATH"] == SANE_PATH
        assert "DAEMON_SECRET" not in env


async def test_a_rank_cannot_grow_the_database_without_bound(
    users: tuple[Identity, Identity], public_tmp: Path
) -> None:
    """Bug: `joined` phase frames and checkpoint frames with 4,000-character paths, within the frame
    budget, added 21,834 events and 13.7 MB in 15 s, kept for 30 days."""
    _, bob = users
    async with shared_box(public_tmp) as d:
        view = await d.run(d.spec(task="tests.adversarial.box_tasks:event_flood", nproc=1, steps=3,
                                  options={"joins": 1000, "checkpoints": 800}))
        assert view.state == JobState.SUCCEEDED, view.root_cause  # the rank is bounded, not failed
        kinds: dict[str, int] = {}
        size = 0
        async with d.client.events(view.id) as events:
            async for event in events:
                kinds[event.kind] = kinds.get(event.kind, 0) + 1
                size += len(json.dumps(event.data))
        assert kinds.get("rank.rejoined", 0) <= 20, kinds  # 1000 re-joins, coalesced
        assert kinds.get("job.checkpointed", 0) <= 201, kinds  # 800 checkpoints: a bounded burst and the last
        assert kinds.get("rank.events_limited") == 1, kinds
        assert size < 200_000, size  # paths clipped: not 800 x 4,000 characters
        await pings(bob, d)

