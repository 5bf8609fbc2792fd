"""Reading and removing what a job left in its owner's tree, as the daemon does: no symlink followed
on the way (a user may swap any directory of their tree for a link to someone else's)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ddpd.daemon.contain.files import read_at
from ddpd.daemon.contain.identity import Identity
from ddpd.daemon.contain.usertree import (
    UnsafePath,
    create_user_file,
    ensure_base,
    ensure_dirs,
    open_user_file,
    reader_for,
    remove_job_dir,
)

OTHER_UID = 54321


@pytest.fixture
def who() -> Identity:
    if os.geteuid() == 0:
        return Identity(uid=OTHER_UID, gid=OTHER_UID, groups=(OTHER_UID,), name="t", home="/nonexistent",
                        shell="/bin/sh")
    return Identity.of(os.getuid())


@pytest.fixture
def state(tmp_path: Path) -> Path:
    ensure_base(tmp_path / "state")
    return tmp_path / "state"


def _log(state: Path, who: Identity, job: str, text: bytes) -> Path:
    fd = create_user_file(state, who, "jobs", job, "attempt-1", name="rank-0.log")
    os.write(fd, text)
    os.close(fd)
    return state / "users" / str(who.uid) / "jobs" / job / "attempt-1" / "rank-0.log"


def test_a_rank_log_is_read_through_the_tree(state: Path, who: Identity) -> None:
    path = _log(state, who, "j1", b"hello\n")
    opener = reader_for(state, who.uid, path)
    assert opener is not None and read_at(path, 0, 100, opener) == b"hello\n"
    assert reader_for(state, who.uid, state / "jobs" / "j1" / "rank-0.log") is None  # an older job's place


def test_a_directory_swapped_for_a_link_to_another_tree_is_refused(state: Path, who: Identity) -> None:
    other = _log(state, who, "theirs", b"secret\n")
    mine = state / "users" / str(who.uid) / "jobs" / "mine"
    ensure_dirs(state, who, "jobs", "mine")
    mine.rmdir()
    mine.symlink_to(other.parent.parent)  # jobs/mine -> jobs/theirs: attempt-1/rank-0.log resolves
    with pytest.raises(UnsafePath, match="symlink"):
        open_user_file(state, who.uid, mine / "attempt-1" / "rank-0.log")
    with pytest.raises(UnsafePath):
        open_user_file(state, who.uid, state / "ddpd.db")  # outside the user's tree


def test_remove_job_dir_removes_the_job_and_follows_no_link(state: Path, who: Identity, tmp_path: Path) -> None:
    _log(state, who, "j1", b"x")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("keep")
    job = state / "users" / str(who.uid) / "jobs" / "j1"
    (job / "link").symlink_to(outside)
    remove_job_dir(state, who.uid, "j1")
    assert not job.exists() and (outside / "keep").exists()
    remove_job_dir(state, who.uid, "j1")  # gone already: nothing to do
    jobs = job.parent
    jobs.rename(state / "moved")
    jobs.symlink_to(outside)  # users/<uid>/jobs -> elsewhere: not followed
    with pytest.raises(UnsafePath):
        remove_job_dir(state, who.uid, "keep")
    assert (outside / "keep").exists()
