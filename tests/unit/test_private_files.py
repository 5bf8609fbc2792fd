"""The daemon's own files (store.private): created root-only whatever the umask, wider ones narrowed,
and the directories others must traverse still created 0755 under the daemon's 077 umask."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddpd.daemon.store.private import Narrowed, create_database, make_dirs, narrow, private_umask
from ddpd.daemon.store.state import StateDB


@pytest.fixture
def daemon_umask() -> Iterator[None]:
    """The daemon's umask for the test (this process's own restored afterwards)."""
    was = private_umask()
    try:
        yield
    finally:
        os.umask(was)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def test_the_database_is_created_0600_even_under_a_wide_umask(tmp_path: Path) -> None:
    was = os.umask(0)
    try:
        create_database(tmp_path)
    finally:
        os.umask(was)
    assert _mode(tmp_path / "ddpd.db") == 0o600
    (tmp_path / "ddpd.db").write_bytes(b"kept")
    create_database(tmp_path)  # an existing one is left as it is (narrow is what changes its mode)
    assert (tmp_path / "ddpd.db").read_bytes() == b"kept"


def test_wider_files_of_the_daemon_are_narrowed_and_nothing_else(tmp_path: Path) -> None:
    for name, mode in (("ddpd.db", 0o644), ("ddpd.db-wal", 0o664), ("ddpd.db-shm", 0o600), ("ddpd.toml", 0o644)):
        (tmp_path / name).write_text("")
        (tmp_path / name).chmod(mode)
    os.mkfifo(tmp_path / "pool.log", 0o666)  # not a regular file: left alone, never blocked on
    (tmp_path / "pool.log").chmod(0o666)
    assert narrow(tmp_path) == [Narrowed(str(tmp_path / "ddpd.db"), "0644", "0600"),
                                Narrowed(str(tmp_path / "ddpd.db-wal"), "0664", "0600")]
    assert [_mode(tmp_path / n) for n in ("ddpd.db", "ddpd.db-wal", "ddpd.db-shm", "ddpd.toml", "pool.log")] == [
        0o600, 0o600, 0o600, 0o644, 0o666]
    assert narrow(tmp_path) == []


def test_a_symlinked_database_is_not_followed_by_the_narrowing(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("")
    target.chmod(0o644)
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "ddpd.db").symlink_to(target)
    assert narrow(tmp_path / "state") == []
    assert _mode(target) == 0o644


def test_missing_parents_are_created_0755_under_the_daemons_umask(tmp_path: Path, daemon_umask: None) -> None:
    make_dirs(tmp_path / "run" / "ddpd")
    assert (_mode(tmp_path / "run"), _mode(tmp_path / "run" / "ddpd")) == (0o755, 0o755)
    make_dirs(tmp_path / "run" / "ddpd")  # there already: nothing changes
    (tmp_path / "file").write_text("")
    with pytest.raises(FileExistsError):
        make_dirs(tmp_path / "file")


def test_a_state_directory_opened_under_a_wide_umask_holds_root_only_files(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / "ddpd.db").write_bytes(b"")
    (state / "ddpd.db").chmod(0o644)
    was = os.umask(0o022)
    try:
        db = StateDB.open_dir(state)
    finally:
        os.umask(was)
    try:
        db.run_sync(lambda conn: conn.execute("INSERT INTO usage VALUES (1, 1.0, 1.0, 1.0)"))
        found = {p.name: _mode(p) for p in state.iterdir()}
    finally:
        db.close()
    assert found == {"ddpd.db": 0o600, "ddpd.db-wal": 0o600, "ddpd.db-shm": 0o600}
