"""Notifications against a real daemon and real ranks: a job's `--notify` command runs as its
submitter, in a cgroup of its own, with the job's facts in its environment; a `--notify-url` gets
them as JSON (a local test server); a hook that hangs is cut off at `notify_timeout`, retried once,
reported as `job.notify_failed`, and leaves nothing, while the daemon keeps answering.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import anyio
import anyio.abc
import pytest

from ddpd.daemon.contain.cgroups import probe
from ddpd.daemon.contain.identity import Identity
from ddpd.protocol import JobState

from ..conftest import REPO, assert_nothing_left, running_daemon
from ..scripts.helpers import SCRIPTS
from ..scripts.userpython import USER_PYTHON
from .test_identity import as_user

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.public_tmp(0o777),
    pytest.mark.xdist_group("users"),
    pytest.mark.skipif(os.geteuid() != 0, reason="hooks run as the submitter: needs root and useradd"),
]
TIMEOUT = 120


def _png_of(path: Path) -> int:
    """The owner of the PNG picture at `path` (AssertionError if it is none)."""
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path
    return path.stat().st_uid


def _hook_wrote(out: Path) -> tuple[dict[str, str], int, str]:
    """The hook's environment, uid and /proc/self/cgroup, as it wrote them."""
    env = dict(line.split("=", 1) for line in Path(f"{out}.env").read_text().splitlines() if "=" in line)
    return env, int(Path(f"{out}.uid").read_text()), Path(f"{out}.cgroup").read_text()


async def test_a_notify_command_runs_as_the_submitter_with_the_jobs_facts(
        users: tuple[Identity, Identity], public_tmp: Path) -> None:
    ann, _ = users
    out = public_tmp / "hook"
    config = public_tmp / "ddpd.toml"
    config.write_text('socket_mode = "0666"\n')
    command = f"env > {out}.env; id -u > {out}.uid; cat /proc/self/cgroup > {out}.cgroup"
    async with running_daemon(public_tmp, "--config", str(config), "--gpus", "0") as d:
        done = await as_user(ann, d, "submit", "--python", USER_PYTHON, "--task", "two-layer", "--steps", "3",
                             "--notify", command)
        assert done.returncode == 0, done.stderr.decode()
        job_id = done.stdout.decode().strip()
        with anyio.fail_after(TIMEOUT):
            job = await d.client.wait(job_id)
        assert job.state == JobState.SUCCEEDED, job.root_cause
        notified = await d.wait_event(None, lambda e: e.job_id == job_id and e.kind.startswith("job.notif"))
        assert (notified.kind, notified.data["hook"], notified.data["notice"]) == ("job.notified", "command", "ended")
        env, uid, cgroup = _hook_wrote(out)
        assert uid == ann.uid  # the submitter, never root
        assert (env["DDPD_JOB_ID"], env["DDPD_JOB_STATE"], env["DDPD_JOB_EVENT"]) == (job_id, "SUCCEEDED", "ended")
        assert env["DDPD_JOB_ROOT_CAUSE"] == "" and float(env["DDPD_JOB_DURATION"]) > 0
        assert float(env["DDPD_JOB_LAST_LOSS"]) == job.ranks[0].loss
        assert env["USER"] == ann.name and env["HOME"] == ann.home
        # the curve picture, drawn as the submitter into the job's folder (matplotlib is a test dependency)
        picture = Path(env["DDPD_JOB_CURVE"])
        assert picture.name == "curve.png" and job_id in picture.parts, env["DDPD_JOB_CURVE"]
        assert _png_of(picture) == ann.uid
        if probe().usable:  # a cgroup of its own, like any of the user's work
            assert f"/notify-{ann.uid}-" in cgroup
        assert_nothing_left([job])


async def _serve_once(listener: anyio.abc.SocketListener, got: list[bytes], received: anyio.Event) -> None:
    """A one-request HTTP server: the body of each POST into `got`, answered 204."""
    async def handle(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            data = b""
            while b"\r\n\r\n" not in data:
                data += await stream.receive()
            head, _, body = data.partition(b"\r\n\r\n")
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            while len(body) < length:
                body += await stream.receive()
            got.append(body)
            await stream.send(b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            received.set()

    await listener.serve(handle)


def _sleepers(marker: str) -> list[int]:
    """Processes whose command line is `sleep MARKER` (or a shell running it)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and f"sleep\0{marker}".encode() in (entry / "cmdline").read_bytes().replace(
                    b" ", b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


async def test_a_webhook_gets_the_json_and_a_hanging_hook_is_cut_off_while_the_daemon_serves(
        short_tmp: Path) -> None:
    config = short_tmp / "ddpd.toml"
    config.write_text('notify = "sleep 613"\nnotify_timeout = 1\n')  # every job's hook: one that hangs
    got: list[bytes] = []
    received = anyio.Event()
    async with anyio.create_task_group() as tg:
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        tg.start_soon(_serve_once, listener, got, received)
        async with running_daemon(short_tmp, "--config", str(config), "--gpus", "0") as d:
            spec = d.spec(script=[str(SCRIPTS / "fails.py"), "--rank", "0", "--raise"], nproc=1, workdir=str(REPO),
                          notify_url=f"http://127.0.0.1:{port}/hook")
            job = await d.run(spec)
            assert job.state == JobState.FAILED
            with anyio.fail_after(30):
                await received.wait()
            body = json.loads(got[0])
            assert (body["id"], body["state"], body["event"]) == (job.id, "FAILED", "ended")
            assert "bad batch on rank 0" in body["root_cause"] and body["duration"] > 0
            assert "curve" in body and body["owner_uid"] == 0  # curve: a picture's path, or null (drawn within 1 s)
            # the hanging command: the daemon answers meanwhile, and cuts it off at its bound, twice
            with anyio.fail_after(1):
                await d.client.ping()
            failed = await d.wait_event(None, lambda e: e.job_id == job.id and e.kind == "job.notify_failed")
            assert failed.data == {"hook": "command", "notice": "ended", "tries": 2,
                                   "error": "did not finish within 1 s"}
            assert _sleepers("613") == []
            assert_nothing_left([job])
        tg.cancel_scope.cancel()
