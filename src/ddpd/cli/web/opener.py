"""`ddpctl web --open`: the browser opens a private file that redirects to the URL, never the URL.

Bug (issue 34, finding 5): the browser was started as `www-browser http://127.0.0.1:P/?token=...`;
any local user read the token in /proc/PID/cmdline, opened the owner's view and cancelled the
owner's jobs. As Jupyter does, the URL with its token goes into an HTML file only its user can read
(0600, in a fresh 0700 directory under the user's runtime directory, else the temporary directory)
that redirects to it, and the browser is given that file's path (`file:///.../open.html`): no
command line and no environment holds the token. The file is removed when the server stops.
"""

from __future__ import annotations

import html
import os
import shutil
import stat
import tempfile
from pathlib import Path

NAME = "open.html"
PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="referrer" content="no-referrer">
<meta http-equiv="refresh" content="0;url={url}">
<title>ddpctl web</title>
</head>
<body>
<p>Opening the ddpd web view: if nothing happens, <a href="{url}">follow this link</a>.</p>
</body>
</html>
"""


def _private_base() -> str | None:
    """$XDG_RUNTIME_DIR where it is a directory of this user that no one else may enter, else None
    (the system's temporary directory: the fresh 0700 directory below keeps the file private there)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if not runtime:
        return None
    try:
        st = os.lstat(runtime)
    except OSError:
        return None
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077:
        return runtime
    return None


def write_redirect(url: str) -> Path:
    """A new 0600 file (in a new 0700 directory) whose page redirects to `url`; its path."""
    folder = Path(tempfile.mkdtemp(prefix="ddpctl-web-", dir=_private_base()))  # 0700, a name of its own
    path = folder / NAME
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as page:
            page.write(PAGE.format(url=html.escape(url, quote=True)))
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return path


def remove_redirect(path: Path) -> None:
    shutil.rmtree(path.parent, ignore_errors=True)
