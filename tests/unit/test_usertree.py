"""The per-user state tree: modes, ownership, and what a user may plant in it (symlinks, FIFOs, links).

Runs as any user (the identity is then this process's own); as root, ownership goes to a uid
that is not root's, as it does for a system daemon.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from ddpd.daemon.contain.identity import Identity
from ddpd.daemon.contain.usertree import UnsafePath, create_user_file, ensure_base, ensure_dirs, ensure_job_dir

OTHER_UID = 54321  # a uid with no files of its own; only used where this process is root


@pytest.fixture
def who() -> Identity:
    if os.geteuid() == 0:
        return Identity(
            uid=OTHER_UID, gid=OTHER_UID, groups=(OTHER_UID,), name="t", home="/nonexistent", shell="/bin/sh"
        )
    return Identity.of(os.getuid())


@pytest.fixture
def state(tmp_path: Path) -> Path:
    ensure_base(tmp_path / "state")
    return tmp_path / "state"


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_tree_is_the_users_and_private(state: Path, who: Identity) -> None:
    path = ensure_job_dir(state, who, "j-1")
    assert path == state / "users" / str(who.uid) / "jobs" / "j-1"
    assert _mode(state) == 0o711 and _mode(state / "users") == 0o711
    for d in (state / "users" / str(who.uid), path.parent, path):
        st = os.lstat(d)
        assert (st.st_uid, st.st_gid, _mode(d)) == (who.uid, who.gid, 0o700)
    fd = create_user_file(state, who, "jobs", "j-1", "attempt-1", name="rank-0.log")
    try:
        os.write(fd, b"hello\n")
        st = os.fstat(fd)
        assert (st.st_uid, stat.S_IMODE(st.st_mode), st.st_nlink) == (who.uid, 0o600, 1)
    finally:
        os.close(fd)
    again = create_user_file(state, who, "jobs", "j-1", "attempt-1", name="rank-0.log")
    os.write(again, b"more\n")
    os.close(again)
    assert (path / "attempt-1" / "rank-0.log").read_bytes() == b"hello\nmore\n"


def _plant(path: Path, who: Identity) -> None:
    if os.geteuid() == 0:
        os.lchown(path, who.uid, who.gid)


def test_a_planted_directory_symlink_is_not_followed(state: Path, who: Identity, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    ensure_dirs(state, who)
    jobs = state / "users" / str(who.uid) / "jobs"
    jobs.symlink_to(victim)
    _plant(jobs, who)
    with pytest.raises(UnsafePath, match="is a symlink or not a directory; not followed"):
        ensure_job_dir(state, who, "j-1")
    with pytest.raises(UnsafePath, match="not followed"):
        create_user_file(state, who, "jobs", "j-1", name="rank-0.log")
    assert list(victim.iterdir()) == []


def test_a_planted_file_symlink_fifo_or_hard_link_is_refused(state: Path, who: Identity, tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious\n")
    attempt = ensure_dirs(state, who, "jobs", "j-1", "attempt-1")
    (attempt / "rank-0.log").symlink_to(victim)
    _plant(attempt / "rank-0.log", who)
    with pytest.raises(UnsafePath, match=r"rank-0\.log is a symlink; not followed"):
        create_user_file(state, who, "jobs", "j-1", "attempt-1", name="rank-0.log")
    os.mkfifo(attempt / "rank-1.log")
    _plant(attempt / "rank-1.log", who)
    with pytest.raises(UnsafePath, match=r"rank-1\.log is not a regular file"):
        create_user_file(state, who, "jobs", "j-1", "attempt-1", name="rank-1.log")
    os.link(victim, attempt / "rank-2.log")
    with pytest.raises(UnsafePath, match="not the user's own single-link file"):
        create_user_file(state, who, "jobs", "j-1", "attempt-1", name="rank-2.log")
    assert victim.read_bytes() == b"precious\n"


def test_a_foreign_directory_is_refused(state: Path, who: Identity) -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a directory to another uid needs root")
    users = state / "users" / str(who.uid)
    users.mkdir()
    os.chown(users, who.uid + 1, who.gid + 1)
    with pytest.raises(UnsafePath, match=f"belongs to uid {who.uid + 1}, not {who.uid}"):
        ensure_job_dir(state, who, "j-1")


@pytest.mark.parametrize("part", ["..", ".", "a/b", ""])
def test_path_components_are_single_names(state: Path, who: Identity, part: str) -> None:
    with pytest.raises(UnsafePath, match="is not a single path component"):
        ensure_dirs(state, who, "jobs", part)


def test_the_state_directory_itself_may_be_the_admins_symlink(tmp_path: Path, who: Identity) -> None:
    real = tmp_path / "data"
    real.mkdir()
    (tmp_path / "state").symlink_to(real)
    ensure_base(tmp_path / "state")
    assert ensure_job_dir(tmp_path / "state", who, "j-1").resolve() == real / "users" / str(who.uid) / "jobs" / "j-1"
