"""A failing notification hook is recorded as failed, with its real status, after one retry
(issue 34, finding 9), against a real daemon.

Bug: a hook's child was not registered with the reaper of inherited children (it leads a process
group of its own, so the reaper took it for an orphan). The reaper reaped it first, the hook's
`wait()` got ECHILD, CPython reported exit status 0, and a hook that exited 3, or a URL on a closed
port, gave `job.notified` and no retry.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import anyio
import anyio.abc
import pytest

from ddpd.protocol import JobState
from ddpd.protocol.control import EventView

from ..conftest import REPO, DaemonProc, running_daemon
from ..scripts.helpers import SCRIPTS

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(os.geteuid() != 0, reason="the root daemon's reaper of inherited children"),
]
TIMEOUT = 120
FINAL = ("job.notified", "job.notify_failed")


async def _answer_503(listener: anyio.abc.SocketListener, posts: list[bytes]) -> None:
    """An HTTP server that answers every POST 503 and keeps its request line in `posts`."""
    async def handle(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            data = b""
            while b"\r\n\r\n" not in data:
                data += await stream.receive()
            posts.append(data.split(b"\r\n", 1)[0])
            await stream.send(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")

    await listener.serve(handle)


async def _ended_hooks(d: DaemonProc, job_id: str, hooks: int) -> list[EventView]:
    """The job's notification events until each of its `hooks` hooks has a final one."""
    seen: list[EventView] = []
    with anyio.fail_after(TIMEOUT):
        async with d.client.events(None, follow=True) as stream:
            async for event in stream:
                if event.job_id == job_id and event.kind.startswith("job.notif"):
                    seen.append(event)
                    if sum(e.kind in FINAL for e in seen) == hooks:
                        return seen
    raise AssertionError(f"the event stream ended before every hook of {job_id} had run: {seen}")


async def test_a_failing_hook_and_a_closed_url_are_retried_once_and_recorded_as_failed(
        short_tmp: Path, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    closed = socket.socket()  # bound, never listening: a connection to it is refused
    closed.bind(("127.0.0.1", 0))
    posts: list[bytes] = []
    async with anyio.create_task_group() as tg:
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        tg.start_soon(_answer_503, listener, posts)
        config = short_tmp / "ddpd.toml"  # the daemon's own hook: a URL that answers 503
        config.write_text(f'notify_url = "http://127.0.0.1:{port}/ddpd"\nnotify_timeout = 30\n')
        async with running_daemon(short_tmp, "--config", str(config), "--gpus", "0") as d:
            closed_url = f"http://127.0.0.1:{closed.getsockname()[1]}/hook"
            job = await d.run(d.spec(script=[str(SCRIPTS / "fails.py"), "--rank", "0", "--raise"], nproc=1,
                                     workdir=str(REPO), notify=f"echo ran >> {runs}; echo no route >&2; exit 3",
                                     notify_url=closed_url))
            assert job.state == JobState.FAILED
            seen = await _ended_hooks(d, job.id, hooks=3)
        tg.cancel_scope.cancel()
    closed.close()
    assert [e.kind for e in seen if e.kind in FINAL] == ["job.notify_failed"] * 3, [(e.kind, e.data) for e in seen]
    by_what = {("command" if e.data["hook"] == "command" else e.data.get("http_status", "refused"), e.kind): e.data
               for e in seen}
    # the command: its real exit status, both times, and it did run twice
    assert by_what["command", "job.notify_retrying"] == {"hook": "command", "notice": "ended",
                                                          "error": "exit status 3: no route", "exit_code": 3}
    assert by_what["command", "job.notify_failed"] == {"hook": "command", "notice": "ended", "tries": 2,
                                                       "error": "exit status 3: no route", "exit_code": 3}
    assert runs.read_text() == "ran\nran\n"
    # the closed port: the poster's failure (exit 1), no HTTP status, tried twice
    for kind in ("job.notify_retrying", "job.notify_failed"):
        refused = by_what["refused", kind]
        assert refused["exit_code"] == 1 and "http_status" not in refused, refused
        assert refused["error"].startswith(f"exit status 1: POST {closed_url}: ") and "refused" in refused["error"]
    assert by_what["refused", "job.notify_failed"]["tries"] == 2
    # the answer 503: its status recorded, and the server saw both tries
    assert by_what[503, "job.notify_failed"]["exit_code"] == 1 and by_what[503, "job.notify_failed"]["tries"] == 2
    assert by_what[503, "job.notify_retrying"]["http_status"] == 503
    assert posts == [b"POST /ddpd HTTP/1.1"] * 2
