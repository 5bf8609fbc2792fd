"""The door's pure parts and the paths it resolves: per-user connection budget, accept backoff,
directories resolved without a planted symlink, the metrics token, a port range held by others."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import anyio
import pytest

from ddpd.daemon.config import Config, ConfigError, check_config
from ddpd.daemon.contain.files import UnsafeDirectory, open_dir_safely, open_in_dir_safely
from ddpd.daemon.control.door import ACCEPT_BACKOFF_MAX, ACCEPT_BACKOFF_MIN, Door, backoff_after, reserve_of
from ddpd.daemon.run.rendezvous import RendezvousError, bind_port, open_rendezvous


def test_one_uid_is_capped_and_the_last_connections_are_kept_for_root() -> None:
    door = Door()
    for _ in range(4):
        assert door.refusal(1000, False, 16, 4) is None
        door.enter(1000)
    refused = door.refusal(1000, False, 16, 4)
    assert refused is not None and "max_connections_per_user = 4" in refused
    for uid in (1001, 1002):
        for _ in range(4):
            door.enter(uid)
    assert door.total == 12 == 16 - reserve_of(16)
    refused = door.refusal(1003, False, 16, 4)  # a new user: the reserve is root's
    assert refused is not None and "kept for root and the admin group" in refused
    assert door.refusal(0, True, 16, 4) is None
    for _ in range(4):
        door.enter(0)
    refused = door.refusal(0, True, 16, 4)
    assert refused is not None and "(max_connections)" in refused
    for _ in range(4):
        door.leave(1000)
    assert 1000 not in door.open and door.refusal(1000, False, 16, 4) is not None  # root holds the rest


def test_accept_backoff_doubles_within_bounds() -> None:
    pauses = [ACCEPT_BACKOFF_MIN]
    for _ in range(10):
        pauses.append(backoff_after(pauses[-1]))
    assert pauses[1] == 2 * ACCEPT_BACKOFF_MIN and pauses[-1] == ACCEPT_BACKOFF_MAX
    assert backoff_after(0.0) == ACCEPT_BACKOFF_MIN


def test_a_directory_swapped_for_a_symlink_in_a_users_tree_is_not_followed(tmp_path: Path) -> None:
    """Bug: rotation opened the backup's directory with O_NOFOLLOW on its last component only."""
    user = tmp_path / "user"
    victim = tmp_path / "victim"
    (user / "job").mkdir(parents=True)
    victim.mkdir()
    os.chown(user, 12345, 12345)  # the user's own directory: a symlink in it is theirs
    (user / "job" / "attempt-1").symlink_to(victim)
    os.chown(user / "job", 12345, 12345)
    with pytest.raises(UnsafeDirectory, match="symlink"):
        open_dir_safely(user / "job" / "attempt-1")
    with pytest.raises(UnsafeDirectory):
        open_in_dir_safely(user / "job" / "attempt-1" / "rank-0.log.1", os.O_WRONLY | os.O_CREAT)
    assert list(victim.iterdir()) == []


def test_a_symlink_only_the_daemon_could_plant_is_followed(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "private" / "state"
    link.parent.mkdir(mode=0o700)
    link.symlink_to(real)
    fd = open_dir_safely(link)
    try:
        assert os.fstat(fd).st_ino == real.stat().st_ino
    finally:
        os.close(fd)


def test_the_metrics_endpoint_needs_a_token_unless_it_is_declared_public() -> None:
    with pytest.raises(ConfigError, match="metrics_public"):
        check_config(Config(metrics_listen="127.0.0.1:9464"))
    check_config(Config(metrics_listen="127.0.0.1:9464", metrics_token="s3cret"))
    check_config(Config(metrics_listen="127.0.0.1:9464", metrics_public=True))
    with pytest.raises(ConfigError, match="not loopback"):
        check_config(Config(metrics_listen="0.0.0.0:9464", metrics_public=True))


@pytest.mark.anyio
async def test_a_loopback_port_range_held_by_others_falls_back_to_an_ephemeral_port() -> None:
    """Bug: one user binding every port of `port_range` made every job fail `rendezvous`."""
    held = bind_port("127.0.0.1", None)
    held.listen()  # another user's listener
    port = held.getsockname()[1]
    try:
        with pytest.raises(RendezvousError, match="no free rendezvous port"):
            bind_port("127.0.0.1", (port, port))
        rdzv = await open_rendezvous("127.0.0.1", (port, port))
        try:
            assert rdzv.port != port and rdzv.listener is not None
            with socket.create_connection(("127.0.0.1", rdzv.port), timeout=5):
                pass
        finally:
            rdzv.close()
    finally:
        held.close()
    await anyio.lowlevel.checkpoint()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
