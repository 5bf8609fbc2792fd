"""Owners: the submitter's uid (SO_PEERCRED) owns a job, only it or root may cancel it, and the
control socket's mode and group decide who may talk to the daemon at all. Tests run as root and
act as a second user (nobody, 65534) through ddpctl subprocesses."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from ddpd.client import RemoteError, WhoAmI
from ddpd.protocol import JobState

from ..conftest import REPO, DaemonProc, running_daemon
from ..scripts.helpers import gated, wait_waiting_at_gate
from ..scripts.userpython import USER_PYTHON, user_env
from ..users import user_python_for_tests

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(os.geteuid() != 0, reason="acting as a second user needs root"),
]

NOBODY = 65534


async def as_nobody(d: DaemonProc, *args: str) -> subprocess.CompletedProcess[bytes]:
    """ddpctl run as uid/gid 65534 (see tests/scripts/as_user.py for why not `user=`)."""
    argv = [sys.executable, "-m", "tests.scripts.as_user", str(NOBODY), str(NOBODY), "--",
            "--socket", str(d.socket), *args]
    with anyio.fail_after(120):
        return await anyio.run_process(argv, check=False, stdin=subprocess.DEVNULL, cwd=str(REPO),
                                       env=user_env(HOME="/tmp", COLUMNS="200"))


def _config(base: Path, text: str) -> Path:
    base.chmod(0o755)  # nobody must reach the socket inside
    path = base / "ddpd.toml"
    path.write_text(text)
    return path


@pytest.fixture
def checkout_for_users() -> Iterator[None]:
    with user_python_for_tests():
        yield


async def test_only_the_owner_or_root_may_cancel(short_tmp: Path, checkout_for_users: None) -> None:
    gate = short_tmp / "gate"
    config = _config(short_tmp, 'socket_mode = "0666"\n')
    async with running_daemon(short_tmp, "--config", str(config), "--cpu-slots", "1", "--gpus", "0") as d:
        assert stat.S_IMODE(d.socket.stat().st_mode) == 0o666
        mine = await d.client.submit(gated(d, gate, name="root's"))
        await wait_waiting_at_gate(d, mine)
        # nobody's jobs wait behind it (one CPU slot)
        # the interpreter nobody's shell would run (the suite's own is closed to nobody)
        done = await as_nobody(d, "submit", "--name", "nobody's", "--workdir", str(REPO), "--python", USER_PYTHON)
        assert done.returncode == 0, done.stderr.decode()
        theirs = done.stdout.decode().strip()
        done = await as_nobody(d, "submit", "--name", "nobody's 2", "--workdir", str(REPO), "--python", USER_PYTHON)
        theirs2 = done.stdout.decode().strip()

        done = await as_nobody(d, "ls", "-o", "json")
        owners = {j["id"]: j["owner_uid"] for j in json.loads(done.stdout)}
        assert owners == {mine: 0, theirs: NOBODY, theirs2: NOBODY}
        done = await as_nobody(d, "ls")
        assert "root" in done.stdout.decode() and "nobody" in done.stdout.decode()

        done = await as_nobody(d, "cancel", mine)
        assert done.returncode == 1
        assert "permission_denied" in done.stderr.decode() and "belongs to uid 0" in done.stderr.decode()
        assert (await d.client.status(mine)).state == JobState.RUNNING

        done = await as_nobody(d, "cancel", theirs)  # the owner may
        assert done.returncode == 0, done.stderr.decode()
        view = (await d.client.cancel(theirs2)).job  # and root may cancel anyone's
        assert view.state == JobState.CANCELLED
        with pytest.raises(RemoteError) as again:
            await d.client.cancel(theirs2)
        assert again.value.code == "not_runnable"

        await d.client.cancel(mine)
        with anyio.fail_after(120):
            final = {j: (await d.client.wait(j)).state for j in (mine, theirs, theirs2)}
        assert final == {mine: "CANCELLED", theirs: "CANCELLED", theirs2: "CANCELLED"}
        events = [e async for e in d.client.events(theirs)]
        assert any(e.kind == "job.state_changed" and e.data["reason"] == f"cancelled by nobody (uid {NOBODY})"
                   for e in events)


async def test_socket_is_0660_by_default_and_closed_to_others(short_tmp: Path) -> None:
    _config(short_tmp, "")
    async with running_daemon(short_tmp, "--gpus", "0") as d:
        st = d.socket.stat()
        assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == 0
        done = await as_nobody(d, "ping")
        assert done.returncode == 3 and "permission denied" in done.stderr.decode()


async def test_socket_group_lets_its_members_in(short_tmp: Path) -> None:
    config = _config(short_tmp, 'socket_group = "nogroup"\n')
    async with running_daemon(short_tmp, "--config", str(config), "--gpus", "0") as d:
        st = d.socket.stat()
        assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == NOBODY
        done = await as_nobody(d, "ping")  # nobody's primary group is nogroup
        assert done.returncode == 0, done.stderr.decode()


async def test_whoami_is_the_caller_as_the_daemon_sees_it(short_tmp: Path) -> None:
    """uid from the socket, name and groups from the system, rights from the config (admin group, reload)."""
    config = _config(short_tmp, 'socket_mode = "0666"\nadmin_group = "nogroup"\n')
    async with running_daemon(short_tmp, "--config", str(config), "--gpus", "0") as d:
        me = await d.client.whoami()
        assert me == WhoAmI(uid=0, name="root", groups=["root"], admin_group="nogroup", detail_of_all=True,
                            may_reload=True, submit_refusal=None)
        done = await as_nobody(d, "whoami", "-o", "json")
        assert done.returncode == 0, done.stderr.decode()
        assert json.loads(done.stdout) == {"uid": NOBODY, "name": "nobody", "groups": ["nogroup"],
                                           "admin_group": "nogroup", "detail_of_all": True, "may_reload": False,
                                           "submit_refusal": None}
        config.write_text('socket_mode = "0666"\nadmin_group = "root"\n')
        await d.client.reload()  # nobody is in the admin group no more
        done = await as_nobody(d, "whoami")
        assert done.returncode == 0, done.stderr.decode()
        rows = [line.split(None, 1) for line in done.stdout.decode().splitlines()]
        shown = {key: value.strip() for key, value in rows}
        assert shown["uid"] == str(NOBODY) and shown["name"] == "nobody" and shown["groups"] == "nogroup"
        assert shown["job"] == "detail  your own jobs' (admin group: root)"
        assert shown["reload"].startswith("not allowed") and shown["submit"] == "allowed"
