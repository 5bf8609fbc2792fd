"""`ddpd serve --log-format journald` sends its records to the journal socket it is given, with
PRIORITY and the event as fields, and nothing to stderr (no job is run: the daemon's own start and
stop are records too)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from pathlib import Path

import anyio
import pytest

from ddpd.daemon.journald import RECORD_LIMIT, decode_record

from ..conftest import DAEMON_START_TIMEOUT, REPO, daemon_argv

pytestmark = pytest.mark.anyio


async def next_record(receiver: socket.socket, event: str) -> dict[str, str]:
    with anyio.fail_after(DAEMON_START_TIMEOUT):
        while True:
            await anyio.wait_readable(receiver)
            record = dict(decode_record(receiver.recv(RECORD_LIMIT + 1024)))
            if record.get("DDPD_EVENT") == event:
                return record


async def test_the_daemon_logs_to_the_journal_socket_it_is_given(short_tmp: Path) -> None:
    path = short_tmp / "journal.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as receiver:
        receiver.bind(str(path))
        argv = [*daemon_argv(short_tmp / "ddpd.sock", short_tmp / "state"), "--log-format", "journald"]
        proc = await anyio.open_process(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        env={**os.environ, "DDPD_JOURNAL_SOCKET": str(path)}, cwd=str(REPO))
        try:
            ready = await next_record(receiver, "daemon.ready")
            assert ready["PRIORITY"] == "6" and ready["SYSLOG_IDENTIFIER"] == "ddpd"
            assert ready["MESSAGE"].startswith("daemon.ready ") and ready["DDPD_SOCKET"] == str(short_tmp / "ddpd.sock")
            proc.send_signal(signal.SIGTERM)
            stopped = await next_record(receiver, "daemon.stopped")
            assert stopped["PRIORITY"] == "6"
            with anyio.fail_after(30):
                assert await proc.wait() == 0
        finally:
            if proc.returncode is None:
                proc.kill()
                with anyio.CancelScope(shield=True):
                    await proc.wait()
        assert proc.stderr is not None
        with anyio.fail_after(10):
            assert b"".join([chunk async for chunk in proc.stderr]) == b""  # every record went to the journal
