"""inotify, just enough to learn which of the daemon's open files were written to (Linux, ctypes).

A watch is added through ``/proc/self/fd/N``: the file the daemon holds open as fd N, whatever
path a job may have swapped since. Only IN_MODIFY is asked for (a write or a truncation); the
kernel merges repeated events of one watch that are not yet read, so a rank that writes a
thousand lines between two reads costs one event. Reads never block (IN_NONBLOCK): `read` drains
what is there and says which watches fired, or that the queue overflowed (then any may have).
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct

IN_MODIFY = 0x00000002
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len (then `len` bytes of name: none for a file watch)
_READ = 64 * 1024

_libc: ctypes.CDLL | None = None


def _lib() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


class Inotify:
    """One inotify instance (an fd of the daemon's, closed by `close`)."""

    def __init__(self) -> None:
        self.fd = _check(_lib().inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC), "inotify_init1")

    def watch(self, fd: int) -> int:
        """A watch of the file open as `fd` (its writes and truncations); OSError when none can be
        added (ENOSPC: the user's watch limit)."""
        path = f"/proc/self/fd/{fd}".encode()
        return _check(_lib().inotify_add_watch(self.fd, path, IN_MODIFY), "inotify_add_watch")

    def unwatch(self, wd: int) -> None:
        """Remove a watch; one already gone (its file deleted and closed) is no error."""
        if _lib().inotify_rm_watch(self.fd, wd) < 0 and ctypes.get_errno() != errno.EINVAL:
            err = ctypes.get_errno()
            raise OSError(err, f"inotify_rm_watch: {os.strerror(err)}")

    def read(self) -> tuple[set[int], bool]:
        """The watches that fired since the last read, and whether the queue overflowed (non-blocking)."""
        fired: set[int] = set()
        overflow = False
        while True:
            try:
                data = os.read(self.fd, _READ)
            except BlockingIOError:
                return fired, overflow
            pos = 0
            while pos + _EVENT.size <= len(data):
                wd, mask, _, length = _EVENT.unpack_from(data, pos)
                pos += _EVENT.size + length
                if mask & IN_Q_OVERFLOW:
                    overflow = True
                elif not mask & IN_IGNORED:
                    fired.add(wd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
