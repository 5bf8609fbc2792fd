"""The web view's door: each connection's peer uid, and a share of connections per uid.

The view listens on 127.0.0.1, where every local user can connect, token or not. Bug (issue 34,
finding 8): another user holding idle connections (1,100, past the owner's NOFILE of 1024) left
the server unable to accept, and the owner's own requests timed out. So the listening socket's
`accept` (`GuardedListener`, handed to hypercorn in place of a plain socket) looks up who opened
each connection, the uid the kernel keeps on the client's socket (sock_diag, as `ss -e` shows it;
/proc/net/tcp where netlink is unavailable; an unknown peer counts as one more other user), and:

- admits at most `PER_UID` connections of one uid at once;
- admits at most `TOTAL` in all, the last `RESERVE` of them only for the view's owner and root;
- answers a connection past its share `503` at once and closes it: it never reaches the server.

An admitted connection gives its place back when it closes (or is collected). Everything here runs
in `accept`, on the event loop: one netlink round trip to the kernel, no wait on anything a user
holds.
"""

from __future__ import annotations

import socket
import struct
import weakref
from collections import Counter
from typing import Any

PER_UID = 32  # connections of one uid at once
TOTAL = 128  # connections at once, all uids together
RESERVE = 32  # of TOTAL, only for the owner and root
UNKNOWN = -1  # a peer whose uid could not be found: one more other user

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 1
NLMSG_ERROR = 2
_NO_COOKIE = 0xFFFFFFFF
_HEADER = struct.Struct("=IHHII")  # nlmsghdr
_ID_AT = _HEADER.size + 4  # inet_diag_msg: family, state, timer, retrans, then its sockid
_ID_SIZE = 36  # of the sockid, what names the socket: the ports (4) and the addresses (32)
_UID_AT = _ID_AT + 48 + 12  # after the sockid (48): expires, rqueue, wqueue, then the uid
TCP_TIME_WAIT = 6  # a socket being closed: the kernel keeps no uid for it (it says 0)
LOOKUP_TIMEOUT = 1.0  # seconds for the kernel's answer (it answers at once)


def _sockid(src: tuple[str, int], dst: tuple[str, int]) -> bytes:
    """inet_diag_sockid of the socket whose own end is `src` and whose peer is `dst` (IPv4)."""
    return (struct.pack("!HH", src[1], dst[1]) + socket.inet_aton(src[0]) + bytes(12)
            + socket.inet_aton(dst[0]) + bytes(12) + struct.pack("=III", 0, _NO_COOKIE, _NO_COOKIE))


def diag_uid(src: tuple[str, int], dst: tuple[str, int]) -> int | None:
    """The uid of the TCP socket whose own end is `src` and whose peer is `dst`, from the kernel's
    sock_diag (an exact lookup, SOCK_DIAG_BY_FAMILY); None where there is none. OSError where
    netlink cannot be used."""
    request = struct.pack("=BBBxI", socket.AF_INET, socket.IPPROTO_TCP, 0, 0xFFFFFFFF) + _sockid(src, dst)
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG) as nl:
        nl.settimeout(LOOKUP_TIMEOUT)
        nl.sendto(_HEADER.pack(_HEADER.size + len(request), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, 1, 0) + request,
                  (0, 0))
        answer = nl.recv(8192)
    if len(answer) < _UID_AT + 4:  # an NLMSG_ERROR (ENOENT: no such socket) or a short answer
        return None
    _, kind, _, _, _ = _HEADER.unpack_from(answer)
    # the kernel's lookup falls back to a listener on the port: only the very socket asked for counts
    if kind != SOCK_DIAG_BY_FAMILY or answer[_ID_AT:_ID_AT + _ID_SIZE] != _sockid(src, dst)[:_ID_SIZE]:
        return None
    if answer[_HEADER.size + 1] == TCP_TIME_WAIT:
        return None
    return int(struct.unpack_from("=I", answer, _UID_AT)[0])


def _hex(addr: tuple[str, int]) -> str:
    """An address as /proc/net/tcp writes it (the 32-bit address in host order, then the port)."""
    return f"{struct.unpack('=I', socket.inet_aton(addr[0]))[0]:08X}:{addr[1]:04X}"


def proc_uid(src: tuple[str, int], dst: tuple[str, int]) -> int | None:
    """As `diag_uid`, from /proc/net/tcp (a line per socket: slower, for where netlink fails)."""
    local, remote = _hex(src), _hex(dst)
    with open("/proc/net/tcp") as table:
        next(table, None)
        for line in table:
            fields = line.split()
            if len(fields) > 7 and fields[1] == local and fields[2] == remote:
                return None if int(fields[3], 16) == TCP_TIME_WAIT else int(fields[7])
    return None


def peer_uid(conn: socket.socket) -> int:
    """The uid that opened the other end of `conn` (a TCP connection on this host), or UNKNOWN."""
    try:
        mine, theirs = conn.getsockname(), conn.getpeername()
    except OSError:  # reset already
        return UNKNOWN
    for lookup in (diag_uid, proc_uid):
        try:
            uid = lookup(theirs, mine)
        except OSError:
            continue
        if uid is not None:
            return uid
    return UNKNOWN


class Door:
    """Who holds how many connections; `admit` says why one may not be held, or takes its place."""

    def __init__(self, owner: int, per_uid: int = PER_UID, total: int = TOTAL, reserve: int = RESERVE) -> None:
        self.owner = owner
        self.per_uid = per_uid
        self.total = total
        self.reserve = reserve
        self.held: Counter[int] = Counter()

    def refusal(self, uid: int) -> str | None:
        if self.held[uid] >= self.per_uid:
            return f"too many connections of uid {uid} (at most {self.per_uid} at once)"
        limit = self.total if uid in (self.owner, 0) else self.total - self.reserve
        if sum(self.held.values()) >= limit:
            return f"too many connections (at most {limit} at once)"
        return None

    def admit(self, uid: int) -> str | None:
        refusal = self.refusal(uid)
        if refusal is None:
            self.held[uid] += 1
        return refusal

    def leave(self, uid: int) -> None:
        self.held[uid] -= 1
        if self.held[uid] <= 0:
            del self.held[uid]


class Admitted(socket.socket):
    """An admitted connection: its place at the door is given back when it is closed or collected."""

    _leave: weakref.finalize[Any, Any] | None = None

    def hold(self, door: Door, uid: int) -> None:
        self._leave = weakref.finalize(self, door.leave, uid)

    def close(self) -> None:
        super().close()
        if self._leave is not None:
            self._leave()  # once: a finalize runs at most once


class GuardedListener(socket.socket):
    """A listening socket whose `accept` admits each connection by its peer's uid (see the module)."""

    def __init__(self, sock: socket.socket, door: Door) -> None:
        super().__init__(sock.family, sock.type, sock.proto, fileno=sock.detach())
        self.door = door

    def accept(self) -> tuple[socket.socket, Any]:
        fd, addr = self._accept()  # type: ignore[attr-defined]
        conn = Admitted(self.family, self.type, self.proto, fileno=fd)
        uid = peer_uid(conn)
        refusal = self.door.admit(uid)
        if refusal is not None:
            _refuse(conn, refusal)
            # what asyncio's accept loop takes for "none left this round": the next one is
            # accepted on the next turn of the loop, after the other tasks ran
            raise ConnectionAbortedError(refusal)
        conn.hold(self.door, uid)
        return conn, addr


def _refuse(conn: socket.socket, why: str) -> None:
    body = f"503 {why}\n".encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    try:
        conn.send(head + body, socket.MSG_DONTWAIT)  # a new connection's buffer is empty: never waits
    except OSError:
        pass
    finally:
        conn.close()
