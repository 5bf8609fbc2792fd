"""`ddpctl web` on a shared box: its token stays its user's, and its door serves its owner while
another user hoards connections (issue 34, findings 5 and 8), against a real daemon and real users.

Bugs: `ddpctl web --open` started the browser as `www-browser http://127.0.0.1:P/?token=...`: any
local user read the token in /proc/PID/cmdline, opened the owner's view and cancelled the owner's
jobs by POST. And the server admitted every connection: another user holding more idle connections
than the owner's NOFILE left it unable to accept, and the owner's own requests timed out.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream

from ddpd.cli.web.door import PER_UID
from ddpd.daemon.contain.identity import Identity

from ..conftest import running_daemon
from ..integration.webserver import web_server
from ..scripts.userpython import USER_PYTHON, user_env

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.public_tmp(0o777),
    pytest.mark.xdist_group("users"),  # useradd/userdel lock /etc/passwd: one worker at a time
    pytest.mark.skipif(os.geteuid() != 0, reason="a second, real user on the box"),
]
TIMEOUT = 60
HOARD = 200  # idle connections another user holds
NOFILE = 128  # the owner's server's descriptors: fewer than HOARD (the bug needed 1,100 against 1,024)
LOW_NOFILE = ("/bin/sh", "-c", f'ulimit -n {NOFILE}; exec "$@"', "sh")  # the owner's shell, then ddpctl web

# another user's client (standard library only): HOARD connections to the port, never a byte sent;
# then it waits (bounded) until all but `keep` were answered and closed by the server, prints what
# it saw as one JSON line, and holds the rest until its stdin closes
HOARDER = r"""
import json, selectors, socket, sys, time
port, n, keep = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
held, failed = [], 0
for _ in range(n):
    s = socket.socket()
    s.settimeout(5)
    try:
        s.connect(("127.0.0.1", port))
    except OSError:
        failed += 1
        s.close()
        continue
    held.append(s)
sel = selectors.DefaultSelector()
for s in held:
    sel.register(s, selectors.EVENT_READ)
refused, said, deadline = 0, "", time.monotonic() + 20
while refused < len(held) - keep and time.monotonic() < deadline:
    for key, _ in sel.select(max(0.0, deadline - time.monotonic())):
        try:
            data = key.fileobj.recv(4096)
        except OSError:
            data = b""
        said = said or data.decode(errors="replace").split("\r\n")[0]
        sel.unregister(key.fileobj)
        key.fileobj.close()
        refused += 1
print(json.dumps({"connected": len(held), "failed": failed, "refused": refused, "said": said}), flush=True)
sys.stdin.read()
"""

# the owner's own request, as the owner: the status of the page at argv[1]
FETCH = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=30).status)"


def _open_to_everyone(base: Path) -> Path:
    """A config whose socket every user may open, in a directory every user may traverse."""
    base.chmod(0o755)
    config = base / "ddpd.toml"
    config.write_text('socket_mode = "0666"\n')
    return config


def _holding(text: str) -> list[str]:
    """The processes (pid and name) whose command line or environment holds `text`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        for part in ("cmdline", "environ"):
            try:
                if text.encode() in Path(f"/proc/{pid}/{part}").read_bytes():
                    found.append(f"{pid} {part}")
            except OSError:
                continue
    return found


def _browser_saw(seen: Path) -> tuple[list[str], str]:
    """The stand-in browser's arguments and environment, as it wrote them down."""
    return Path(f"{seen}.argv").read_text().splitlines(), Path(f"{seen}.env").read_text()


def _owned_modes(path: Path) -> tuple[tuple[int, int], tuple[int, int]]:
    """(owner, mode) of `path` and of its folder."""
    st, folder = path.stat(), path.parent.stat()
    return (st.st_uid, stat.S_IMODE(st.st_mode)), (folder.st_uid, stat.S_IMODE(folder.st_mode))


def _nofile(pid: int) -> int:
    """The soft limit of open files of `pid`."""
    line = next(x for x in Path(f"/proc/{pid}/limits").read_text().splitlines() if x.startswith("Max open files"))
    return int(line.split()[3])


@asynccontextmanager
async def hoarding(who: Identity, port: int) -> AsyncIterator[dict[str, Any]]:
    """`who` holds HOARD idle connections to `port` for the block; what it saw."""
    proc = await anyio.open_process([USER_PYTHON, "-c", HOARDER, str(port), str(HOARD), str(PER_UID)],
                                    user=who.uid, group=who.gid, extra_groups=[], cwd="/",
                                    env={"PATH": "/usr/bin:/bin"})
    try:
        assert proc.stdout is not None
        with anyio.fail_after(TIMEOUT):
            line = await BufferedByteReceiveStream(proc.stdout).receive_until(b"\n", 1 << 16)
        yield json.loads(line)
    finally:
        with anyio.CancelScope(shield=True):
            assert proc.stdin is not None
            await proc.stdin.aclose()
            with anyio.move_on_after(10):
                await proc.wait()
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


async def test_open_gives_the_browser_a_private_file_and_the_token_is_on_no_command_line(
        users: tuple[Identity, Identity], short_tmp: Path, public_tmp: Path) -> None:
    ann, eve = users
    config = _open_to_everyone(short_tmp)
    seen = public_tmp / "browser"
    browser = public_tmp / "browser.sh"  # a stand-in: it writes down its argv and environment
    browser.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {seen}.argv\nenv > {seen}.env\necho done > {seen}\n")
    browser.chmod(0o755)
    os.mkfifo(seen)  # the handshake: the browser has written what it was given
    seen.chmod(0o666)
    reader = os.open(seen, os.O_RDONLY | os.O_NONBLOCK)
    redirect: Path | None = None
    try:
        async with running_daemon(short_tmp, "--config", str(config)) as d, \
                web_server(d.socket, "--open", uid=ann.uid, env={"BROWSER": str(browser)}) as web:
            with anyio.fail_after(TIMEOUT):
                await anyio.wait_readable(reader)
            argv, environ = _browser_saw(seen)
            assert web.token not in " ".join(argv) and web.token not in environ
            assert _holding(web.token) == []  # no command line nor environment on the box holds it
            [page] = argv
            assert page.startswith("file:///") and page.endswith("/open.html"), argv
            redirect = Path(page.removeprefix("file://"))
            assert _owned_modes(redirect) == ((ann.uid, 0o600), (ann.uid, 0o700))
            assert f'<meta http-equiv="refresh" content="0;url={web.url}">' in await anyio.Path(redirect).read_text()
            done = await anyio.run_process(["/bin/cat", str(redirect)], user=eve.uid, group=eve.gid,
                                           extra_groups=[], cwd="/", check=False)
            assert done.returncode != 0 and web.token.encode() not in done.stdout
            async with httpx.AsyncClient(timeout=30) as http:  # where it leads: the owner's view
                assert (await http.get(web.url)).status_code == 200
    finally:
        os.close(reader)
    assert redirect is not None and not await anyio.Path(redirect.parent).exists()  # removed at the stop


async def test_the_owner_is_served_while_another_user_hoards_idle_connections(
        users: tuple[Identity, Identity], short_tmp: Path) -> None:
    ann, eve = users
    config = _open_to_everyone(short_tmp)
    async with running_daemon(short_tmp, "--config", str(config)) as d, \
            web_server(d.socket, uid=ann.uid, prefix=LOW_NOFILE) as web, \
            hoarding(eve, int(web.host.rsplit(":", 1)[1])) as seen:
        assert _nofile(web.proc.pid) == NOFILE  # fewer descriptors than eve's connections
        # eve's share is held, the rest answered 503 at once and closed
        assert seen["connected"] == HOARD and seen["refused"] == HOARD - PER_UID, seen
        assert seen["said"] == "HTTP/1.1 503 Service Unavailable", seen
        # while eve holds her share, idle: the owner is answered, and root
        with anyio.fail_after(TIMEOUT):
            done = await anyio.run_process([USER_PYTHON, "-c", FETCH, web.url], user=ann.uid, group=ann.gid,
                                           extra_groups=[], cwd="/", env=user_env(HOME="/tmp"), check=False)
        assert (done.returncode, done.stdout.strip()) == (0, b"200"), done.stderr.decode()[-2000:]
        async with httpx.AsyncClient(timeout=30) as http:
            with anyio.fail_after(TIMEOUT):
                assert (await http.get(web.at("/api/daemon"))).status_code == 200
