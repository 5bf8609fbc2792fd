"""The web view's door in process: each connection's peer uid as the kernel keeps it (sock_diag and
/proc/net/tcp agree), a share per uid with a reserve for the owner and root, a refused connection
answered 503 and closed, an admitted one's place given back when it closes; and `--open`'s
redirect file, private to its user."""

from __future__ import annotations

import html
import os
import socket
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddpd.cli.web.door import UNKNOWN, Door, GuardedListener, diag_uid, peer_uid, proc_uid
from ddpd.cli.web.opener import remove_redirect, write_redirect


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    sock = socket.create_server(("127.0.0.1", 0))
    yield sock
    sock.close()


def test_a_connections_peer_uid_is_the_kernels_by_either_lookup(listener: socket.socket) -> None:
    with socket.create_connection(listener.getsockname()) as client:
        conn, _ = listener.accept()
        with conn:
            ours, theirs = conn.getsockname(), conn.getpeername()
            assert diag_uid(theirs, ours) == proc_uid(theirs, ours) == os.getuid() == peer_uid(conn)
            assert client.getsockname() == theirs
            assert diag_uid(ours, ("127.0.0.1", 1)) is None and proc_uid(ours, ("127.0.0.1", 1)) is None


def test_each_uid_has_a_share_and_the_owner_and_root_a_reserve() -> None:
    door = Door(owner=1000, per_uid=2, total=5, reserve=2)
    assert [door.admit(2000), door.admit(2000)] == [None, None]
    assert door.admit(2000) == "too many connections of uid 2000 (at most 2 at once)"
    assert door.admit(3000) is None
    assert door.admit(UNKNOWN) == "too many connections (at most 3 at once)"  # others: total less reserve
    assert [door.admit(1000), door.admit(0)] == [None, None]  # the reserve
    assert door.admit(1000) == "too many connections (at most 5 at once)"
    door.leave(2000)
    assert door.admit(1000) is None and door.held == {2000: 1, 3000: 1, 1000: 2, 0: 1}


def test_a_connection_past_its_share_is_answered_503_and_a_closed_one_gives_its_place_back(
        listener: socket.socket) -> None:
    door = Door(owner=os.getuid() + 1, per_uid=1)  # this process is "another user" with a share of 1
    guarded = GuardedListener(listener, door)
    first, second = socket.create_connection(guarded.getsockname()), socket.create_connection(guarded.getsockname())
    try:
        conn, _ = guarded.accept()
        assert door.held == {os.getuid(): 1}
        with pytest.raises(ConnectionAbortedError, match=f"too many connections of uid {os.getuid()}"):
            guarded.accept()
        second.settimeout(10)
        assert second.recv(4096).startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
        conn.close()
        assert door.held == {}
        conn.close()  # twice: given back once
        assert door.held == {}
    finally:
        first.close()
        second.close()
        guarded.close()


def test_the_redirect_file_is_its_users_alone_and_leads_to_the_url() -> None:
    url = "http://127.0.0.1:8123/?token=a&b<c>"
    path = write_redirect(url)
    try:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        assert f'content="0;url={html.escape(url)}"' in path.read_text() and "<c>" not in path.read_text()
    finally:
        remove_redirect(path)
    assert not path.parent.exists()


def test_the_redirect_goes_to_the_runtime_dir_only_where_it_is_private(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    for mode, inside in ((0o700, True), (0o755, False)):
        runtime = tmp_path / f"run-{mode:o}"
        runtime.mkdir()
        runtime.chmod(mode)
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
        path = write_redirect("http://127.0.0.1:1/?token=t")
        try:
            assert (path.parent.parent == runtime) is inside
        finally:
            remove_redirect(path)
