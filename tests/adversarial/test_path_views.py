"""A submit's paths are checked as its submitter: a refusal says nothing the submitter could not see
(issue 34, finding 7).

Bug: `admission.check_paths` stat'ed the script and the working directory as root and said which
was missing: any submitter learnt whether `/root/.bashrc`, or a file in another user's 0700 home,
existed ("does not exist" for one, a job accepted for the other).

Here Ann names paths under Bob's 0700 home and under /root, one of each pair there and one not:
each pair is refused with the same words (permission denied to her), as a script, as a relative
script, and as a working directory. Bob, who can read his own script, is accepted. Nothing of the
checks is left: no process of Ann's, no zombie of the daemon.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from ddpd.daemon.contain.identity import Identity
from ddpd.protocol import JobSpec, JobState

from ..scripts.userpython import USER_PYTHON
from ..users import plain_env, submit_as
from .test_shared_box import TIMEOUT, pings, shared_box

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.xdist_group("users"),  # useradd/userdel lock /etc/passwd: one worker at a time
    pytest.mark.skipif(os.geteuid() != 0, reason="a root daemon and real users"),
]


@pytest.fixture
def roots_file() -> Iterator[Path]:
    """A file in root's home, which other users cannot enter."""
    home = Path("/root")
    if not home.is_dir() or home.stat().st_mode & 0o001:
        pytest.skip("/root is open to other users here")
    path = home / f"ddpd-probe-{uuid.uuid4().hex[:8]}.py"
    path.write_text("print('root only')\n")
    try:
        yield path
    finally:
        path.unlink()


def spec(*, script: list[str] | None = None, workdir: str = "/tmp") -> JobSpec:
    task = None if script is not None else "two-layer"
    return JobSpec(task=task, script=script, nproc=1, workdir=workdir, python=USER_PYTHON, environ=plain_env())


def processes_of(uid: int) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        try:
            if name.isdigit() and os.stat(f"/proc/{name}").st_uid == uid:
                found.append(int(name))
        except OSError:
            continue
    return found


async def test_what_another_user_or_root_keeps_closed_reads_the_same_there_or_not(
        users: tuple[Identity, Identity], public_tmp: Path, roots_file: Path) -> None:
    ann, bob = users
    home = public_tmp / "bob"
    home.mkdir(mode=0o700)
    (home / "train.py").write_text("print('bob')\n")
    for path in (home, home / "train.py"):
        os.chown(path, bob.uid, bob.gid)
    (home / "train.py").chmod(0o600)
    (home / "data").mkdir()
    os.chown(home / "data", bob.uid, bob.gid)
    missing = roots_file.with_name(roots_file.name.replace("probe", "missing"))
    pairs = {  # what Ann submits: naming what is there, and what is not
        "bob's script": (spec(script=[str(home / "train.py")]), spec(script=[str(home / "nope.py")])),
        "bob's script, relative": (spec(script=["train.py"], workdir=str(home)),
                                   spec(script=["nope.py"], workdir=str(home))),
        "bob's directory": (spec(workdir=str(home / "data")), spec(workdir=str(home / "nope.py"))),
        "root's file": (spec(script=[str(roots_file)]), spec(script=[str(missing)])),
    }
    async with shared_box(public_tmp) as d:
        for what, (there, absent) in pairs.items():
            with anyio.fail_after(TIMEOUT):
                said = [await submit_as(ann, d, s) for s in (there, absent)]
            assert all(s.startswith("refused ") for s in said), (what, said)
            here, gone = (Path(str(s.workdir if s.script is None else s.script[0])).name for s in (there, absent))
            assert said[0].replace(here, "NAME") == said[1].replace(gone, "NAME"), (what, said)
            assert f"permission denied to user {ann.name} (uid {ann.uid})" in said[0], (what, said)
            assert "does not exist" not in said[1], (what, said)
        his = await submit_as(bob, d, spec(script=[str(home / "train.py")], workdir=str(home)))
        assert not his.startswith("refused"), his  # his own, closed to everyone else: checked as him
        await d.client.cancel(his)
        with anyio.fail_after(TIMEOUT):
            assert (await d.client.wait(his)).state in (JobState.CANCELLED, JobState.SUCCEEDED)
        await pings(ann, d)
        assert processes_of(ann.uid) == []  # every check of hers ended with its answer
