"""The default socket's directory: refused when another user controls it (they could listen there
and receive the submissions), created 0700 by the daemon. Directories of other owners are made
with os.chown, so the tests that need them run as root."""

from __future__ import annotations

import os
from pathlib import Path

import anyio
import pytest

from ddpd.client import AsyncClient, UnsafeSocket
from ddpd.protocol.paths import UnsafeSocketDir, check_socket_dir, client_socket_path, make_runtime_dir

OTHER_UID = 54321  # no such user: its name cannot be shown, its uid is
as_root = pytest.mark.skipif(os.getuid() != 0, reason="chown to another user needs root")


def test_own_private_or_sticky_directories_and_missing_ones_pass(tmp_path: Path) -> None:
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    check_socket_dir(private)
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)  # as /tmp: others may write, but not replace what is yours
    check_socket_dir(sticky)
    check_socket_dir(tmp_path / "missing")


def test_writable_by_others_without_the_sticky_bit_is_refused(tmp_path: Path) -> None:
    for mode in (0o777, 0o770, 0o722):
        path = tmp_path / f"m{mode:o}"
        path.mkdir()
        path.chmod(mode)
        with pytest.raises(UnsafeSocketDir, match=f"mode 0{mode:o}") as caught:
            check_socket_dir(path)
        assert caught.value.path == path and str(path) in str(caught.value)


def test_a_symlink_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "real"
    target.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(UnsafeSocketDir, match="a symlink"):
        check_socket_dir(tmp_path / "link")


@as_root
def test_a_directory_of_another_user_is_refused_naming_its_owner(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafeSocketDir, match=f"owned by uid {OTHER_UID}, not by you") as caught:
        check_socket_dir(theirs)
    assert str(theirs) in str(caught.value)
    # root's own directory is trusted by every user; the owner trusts theirs
    check_socket_dir(tmp_path, uid=OTHER_UID)
    check_socket_dir(theirs, uid=OTHER_UID)


@as_root
@pytest.mark.anyio
async def test_the_client_refuses_a_default_socket_dir_of_another_user(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DDPD_SOCKET", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    planted = tmp_path / "ddpd"
    planted.mkdir(mode=0o755)
    os.chown(planted, OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafeSocketDir):
        client_socket_path()
    client = AsyncClient()  # made without error: the refusal comes when it would connect
    assert client.socket_path == planted / "ddpd.sock"
    with anyio.fail_after(10), pytest.raises(UnsafeSocket, match=f"{planted}: owned by uid {OTHER_UID}"):
        await client.ping()
    # an explicit socket is the caller's choice
    monkeypatch.setenv("DDPD_SOCKET", str(planted / "ddpd.sock"))
    assert client_socket_path() == planted / "ddpd.sock"


def test_the_runtime_dir_is_created_private(tmp_path: Path) -> None:
    path = tmp_path / "run" / "ddpd"
    old = os.umask(0)
    try:
        make_runtime_dir(path)
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o700
    make_runtime_dir(path)  # again: it exists, and is fine


@as_root
def test_the_daemon_refuses_a_default_runtime_directory_someone_else_made(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon side: another user who created `$XDG_RUNTIME_DIR/ddpd` first does not get the socket."""
    from ddpd.daemon.control.server import prepare_socket_path

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    taken = tmp_path / "ddpd"
    taken.mkdir(mode=0o755)
    os.chown(taken, OTHER_UID, OTHER_UID)
    with pytest.raises(OSError, match=str(OTHER_UID)):
        prepare_socket_path(taken / "ddpd.sock")
    os.chown(taken, 0, 0)
    prepare_socket_path(taken / "ddpd.sock")  # the user's own: accepted


def test_a_users_directories_come_from_platformdirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ddpd.protocol import paths

    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    assert paths.user_runtime_dir() == runtime / "ddpd"
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setattr(paths.os, "getuid", lambda: 54321)  # a user's daemon, not root's
    monkeypatch.delenv("STATE_DIRECTORY", raising=False)
    assert paths.daemon_state_dir() == tmp_path / "state" / "ddpd"
    monkeypatch.setattr(paths.os, "getuid", lambda: 0)  # root keeps the system's directory
    assert paths.daemon_state_dir() == Path("/var/lib/ddpd")
