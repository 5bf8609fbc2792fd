"""The root daemon's state is root's alone, whatever shell started it (issue 34, finding 4).

Bug: the daemon set neither its umask nor its database's mode. Started from a root shell with
umask 022 (`sudo ddpd serve`, the README's `ddpd serve &`, the Kubernetes example), `ddpd.db`, its
`-wal` and `-shm` were 0644 in a 0711 directory, and any local user read every job's exported
environment (API tokens) by the documented path, which the daemon itself refuses to show them.
"""

from __future__ import annotations

import os
import sqlite3
import stat
from pathlib import Path

import anyio
import pytest

from ddpd.daemon.contain.identity import Identity
from ddpd.protocol import JobState

from ..conftest import running_daemon

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.xdist_group("users"),  # useradd/userdel lock /etc/passwd: one worker at a time
    pytest.mark.skipif(os.geteuid() != 0, reason="a root daemon and a second, real user"),
]

UMASK_022 = ("/bin/sh", "-c", 'umask 022; exec "$@"', "sh")  # the root shell that starts the daemon
SECRET = "API_TOKEN=only-for-root-and-its-owner"


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def _umask(pid: int) -> int:
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("Umask:"))
    return int(line.split()[1], 8)


def _left_by_a_wide_daemon(state: Path) -> None:
    """What a daemon of before left, started under umask 022: a 0755 state directory holding a
    0644 database with a secret in it, and a 0644 pool.log."""
    state.mkdir(mode=0o755)
    state.chmod(0o755)
    db = sqlite3.connect(state / "ddpd.db")
    db.execute("CREATE TABLE secrets (value TEXT)")
    db.execute("INSERT INTO secrets VALUES (?)", (SECRET,))
    db.commit()
    db.close()
    (state / "pool.log").write_text("a warm worker's output\n")
    for name in ("ddpd.db", "pool.log"):
        (state / name).chmod(0o644)


async def _read_as(who: Identity, path: Path) -> tuple[int, str]:
    done = await anyio.run_process(["/bin/cat", str(path)], user=who.uid, group=who.gid, extra_groups=[],
                                   cwd="/", env={"PATH": "/usr/bin:/bin"}, check=False)
    return done.returncode, (done.stdout + done.stderr).decode(errors="replace")


async def test_a_daemon_started_under_umask_022_keeps_its_database_root_only(
        plain_users: tuple[Identity, Identity], public_tmp: Path) -> None:
    _, eve = plain_users
    state = public_tmp / "state"
    _left_by_a_wide_daemon(state)
    async with running_daemon(public_tmp, "--gpus", "0", state_dir=state, prefix=UMASK_022) as d:
        assert _umask(d.proc.pid) == 0o077  # the shell's 022 is not the daemon's
        job = await d.run(d.spec(task="two-layer", steps=2, nproc=1, env={"NOT_FOR_EVE": SECRET}))
        assert job.state == JobState.SUCCEEDED, job.root_cause
        files = [state / name for name in ("ddpd.db", "ddpd.db-wal", "ddpd.db-shm", "pool.log")]
        assert all(f.exists() for f in files), sorted(p.name for p in state.iterdir())
        assert {f.name: f"{_mode(f):04o}" for f in files} == dict.fromkeys((f.name for f in files), "0600")
        assert all(f.stat().st_uid == 0 for f in files)
        assert (_mode(state), _mode(state / "users")) == (0o711, 0o711)
        narrowed = next(e for e in d.logs if e.get("event") == "state.files_narrowed")
        assert {(f["path"], f["was"], f["now"]) for f in narrowed["files"]} == {
            (str(state / "ddpd.db"), "0644", "0600"), (str(state / "pool.log"), "0644", "0600")}
        for f in files:  # another user, by the documented path: nothing
            rc, said = await _read_as(eve, f)
            assert rc != 0 and "Permission denied" in said and SECRET not in said, (f, rc, said)
