"""Run ddpctl as another user: ``python -m tests.scripts.as_user UID GID -- ddpctl args...``.

The interpreter may live where that user cannot read (a venv under /root), so it starts as
root, imports everything ddpctl needs, then drops to UID/GID (no supplementary groups) before
it opens the socket: the daemon sees UID through SO_PEERCRED, and the socket's permissions
are checked against UID/GID as for any other client.
"""

from __future__ import annotations

import importlib
import os
import sys

from ddpd.cli import main as ddpctl_main

# imported lazily by click and rich; import them while they can still be read
EAGER = ("difflib", "gettext", "shutil", "textwrap", "click.formatting", "click.exceptions",
         "rich.live", "rich.table", "rich.console", "rich.text", "rich.segment",
         "rich._wrap", "rich.jupyter", "rich.traceback", "rich.markup", "rich.emoji",
         "rich.control", "rich.live_render", "rich.file_proxy", "rich.screen", "rich.region", "rich.box",
         "rich.padding", "rich.containers", "rich.measure", "rich.styled", "rich.abc", "rich.pager",
         "rich._export_format", "rich._log_render", "encodings.idna", "pwd", "grp", "queue", "threading",
         # the blocking client runs the async one on an asyncio loop in a thread
         "asyncio", "anyio._backends._asyncio", "anyio._core._sockets", "anyio._core._streams", "anyio.to_thread",
         "anyio.streams.memory", "anyio.streams.stapled", "anyio.streams.tls", "anyio.abc._sockets")


def main() -> None:
    for name in EAGER:
        importlib.import_module(name)
    uid, gid, sep, *args = sys.argv[1:]
    assert sep == "--", "usage: as_user UID GID -- ARGS..."
    os.chdir("/")
    os.setgroups([])
    os.setgid(int(gid))
    os.setuid(int(uid))
    sys.argv = ["ddpctl", *args]
    ddpctl_main()


if __name__ == "__main__":
    main()
