"""libnftables in the daemon's own process: one context, its netlink socket held for the daemon's life.

Why not the ``nft`` command: a table made with ``flags owner`` (Linux 5.12) belongs to the netlink
socket that made it, no other process may change it, and the kernel deletes it, rules and all, when
that socket closes. Made through this context, the daemon's rules end with the daemon however it
ends (``kill -9`` included), and no process starts on a job's launch path. The socket is made
close-on-exec here (libnftables leaves it inheritable): a rank or helper the daemon starts never
holds it, so it never keeps the table alive, and never reaches it.

libnftables ends the process when it cannot open its netlink socket; `Nft` opens one itself
first and raises NftError instead. A context is not thread-safe: `run` takes a lock.

Blocking calls (netlink to the kernel): call them from a thread.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import threading

DEFAULT_LIBRARY = "libnftables.so.1"  # Debian's libnftables1, which the nftables package pulls in
NETLINK_NETFILTER = 12
_OUTPUT_HANDLE = 1 << 3  # NFT_CTX_OUTPUT_HANDLE: "# handle N" after each object
_OUTPUT_ECHO = 1 << 5  # NFT_CTX_OUTPUT_ECHO: what a command added, with its handle


class NftError(RuntimeError):
    """libnftables is missing, cannot start, or refused a command (the text says which and why)."""


def _load(library: str) -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL(library)
    except OSError as exc:
        raise NftError(f"cannot load {library} (install nftables): {exc}") from None
    ptr = ctypes.c_void_p
    lib.nft_ctx_new.argtypes, lib.nft_ctx_new.restype = [ctypes.c_uint32], ptr
    lib.nft_ctx_buffer_output.argtypes = lib.nft_ctx_buffer_error.argtypes = lib.nft_ctx_free.argtypes = [ptr]
    lib.nft_ctx_free.restype = None
    lib.nft_ctx_output_set_flags.argtypes = [ptr, ctypes.c_uint]
    lib.nft_ctx_output_set_flags.restype = None
    lib.nft_run_cmd_from_buffer.argtypes, lib.nft_run_cmd_from_buffer.restype = [ptr, ctypes.c_char_p], ctypes.c_int
    for name in ("nft_ctx_get_output_buffer", "nft_ctx_get_error_buffer"):
        getattr(lib, name).argtypes, getattr(lib, name).restype = [ptr], ctypes.c_char_p
    return lib


def _probe_netlink() -> None:
    """What libnftables would exit the process over: no netfilter netlink socket."""
    try:
        socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER).close()
    except OSError as exc:
        raise NftError(f"no netfilter netlink socket (nf_tables not in this kernel?): {exc.strerror}") from None


def _netfilter_sockets(fds: set[int]) -> list[int]:
    found = []
    for fd in fds:
        try:
            with socket.socket(fileno=os.dup(fd)) as sock:
                if sock.family == socket.AF_NETLINK and sock.proto == NETLINK_NETFILTER:
                    found.append(fd)
        except OSError:
            continue
    return found


def _open_fds() -> set[int]:
    return {int(name) for name in os.listdir("/proc/self/fd")}


class Nft:
    """One libnftables context (the daemon keeps one for its life: `contain.portfence`)."""

    def __init__(self, library: str = DEFAULT_LIBRARY) -> None:
        _probe_netlink()
        self._lib = _load(library)
        self._lock = threading.Lock()
        before = _open_fds()
        ctx = self._lib.nft_ctx_new(0)
        if not ctx:
            raise NftError("nft_ctx_new failed")
        self._ctx: int = ctx
        for fd in _netfilter_sockets(_open_fds() - before):
            fcntl.fcntl(fd, fcntl.F_SETFD, fcntl.fcntl(fd, fcntl.F_GETFD) | fcntl.FD_CLOEXEC)
        self._lib.nft_ctx_buffer_output(ctx)
        self._lib.nft_ctx_buffer_error(ctx)
        self._lib.nft_ctx_output_set_flags(ctx, _OUTPUT_HANDLE | _OUTPUT_ECHO)

    def run(self, commands: str) -> str:
        """Blocking: run `commands` (nft's syntax, one batch); what they printed (with handles)."""
        with self._lock:
            if not self._ctx:
                raise NftError("the nftables context is closed")
            rc = self._lib.nft_run_cmd_from_buffer(self._ctx, commands.encode())
            out = (self._lib.nft_ctx_get_output_buffer(self._ctx) or b"").decode(errors="replace")
            err = (self._lib.nft_ctx_get_error_buffer(self._ctx) or b"").decode(errors="replace")
        if rc != 0:
            first = next((line for line in err.splitlines() if line.strip()), "no reason given")
            raise NftError(first.removeprefix("Error: ").strip()[:500])
        return out

    def close(self) -> None:
        """Free the context and close its socket (a table it owns goes with it)."""
        with self._lock:
            if self._ctx:
                self._lib.nft_ctx_free(self._ctx)
                self._ctx = 0
