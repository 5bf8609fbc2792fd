"""Port fences: from this host, only a job's owner (and root) can connect to the address and port
the daemon bound for the job.

Each port a job's store or multi-node endpoint listens on gets one nftables rule in this daemon's
own table (``inet ddpd-<tag>``, chain ``output``, on locally generated traffic): a TCP connection to
that address and port (``ip daddr A tcp dport P``, ``ip6 daddr`` for IPv6; a wildcard bind: the port
on every local address of its family, ``fib daddr type local``) from a socket whose owner
(``meta skuid``) is neither the job's user nor root is refused with a reset. The same port on
another address is someone else's business. The daemon binds the socket, installs the rule, and
only then listens (`run.rendezvous`): the rule never covers a port another process holds, and no
connection comes before it. It is removed with the attempt (or the job's rendezvous). Connections
from other machines are not this rule's business (docs/multinode.md).

The table is made through the daemon's own libnftables context (`nftables.Nft`) with
``flags owner``: no other process may change it, and the kernel deletes it, rules and all, when
the daemon's process ends, however it ends. A killed daemon's rules block no one. On a kernel
without owner tables (before 5.12) the table is a plain one; `Fences.open`, at the daemon's start,
deletes that table of this daemon's killed run and, in other plain ddpd tables (the shared
``inet ddpd`` of earlier versions included), the rules of daemons that are gone.

Where fences cannot work (no libnftables, no CAP_NET_ADMIN, not root), `Fences.unavailable` says
why: a single-node job runs unfenced and says so (``job.port_unfenced``); a multi-node job's owner
is `PortOwner.required` (unless the operator set ``allow_unfenced``), and `fence_port` raises.

Blocking calls (netlink): call them from a thread; `fence_port` and `unfence` do.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

import anyio.to_thread
import structlog

from .nftables import DEFAULT_LIBRARY, Nft, NftError

log = structlog.get_logger("ddpd")

TABLE_LEGACY = "ddpd"  # the table every daemon shared before tables were per daemon: swept, never made
CHAIN = "output"
_HANDLE = re.compile(r"# handle (\d+)\s*$")
_LABEL = re.compile(r"^[A-Za-z0-9._:/-]{1,64}$")
_TAG = re.compile(r"^ddpd-[0-9a-f]{12}$")
_OWNER = re.compile(r'comment "(ddpd-[0-9a-f]+) p(\d+) ')  # the daemon's tag and pid
_TABLES = re.compile(r"^table inet (ddpd(?:-[0-9a-f]{12})?)\s*(?:#.*)?$", re.MULTILINE)


class FenceError(RuntimeError):
    """The rule could not be installed (the text says why)."""


def daemon_tag(state_dir: Path) -> str:
    """This daemon's mark (and its table's name): the same across its restarts, another daemon's differs."""
    return "ddpd-" + hashlib.sha256(str(state_dir.resolve()).encode()).hexdigest()[:12]


def match_text(address: str, port: int) -> str:
    """The connections a rule is about: TCP to `port` on `address` (an IPv4-mapped IPv6 address is
    its IPv4 one); on every local address for a wildcard (``0.0.0.0``: IPv4's; ``::``: both)."""
    try:
        ip = ipaddress.ip_address(address.partition("%")[0])
    except ValueError:
        raise FenceError(f"not an address: {address[:100]!r}") from None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_unspecified:
        family = "meta nfproto ipv4 " if ip.version == 4 else ""
        return f"{family}tcp dport {port} fib daddr type local"
    return f"{'ip' if ip.version == 4 else 'ip6'} daddr {ip} tcp dport {port}"


def rule_text(address: str, port: int, uids: set[int], comment: str) -> str:
    """The rule (after ``add rule inet <table> output``): refuse connections to `address`:`port` from
    this host's sockets of any user but `uids`."""
    allowed = ", ".join(str(u) for u in sorted(uids))
    return f'{match_text(address, port)} meta skuid != {{ {allowed} }} reject with tcp reset comment "{comment}"'


@dataclass(frozen=True)
class Fence:
    """One installed rule."""

    address: str
    port: int
    handle: int
    table: str


def _daemon_alive(pid: int) -> bool:
    try:
        return b"ddpd" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _rules(listing: str) -> dict[int, tuple[str, int]]:
    """The ddpd rules of a table's listing: handle -> (daemon tag, daemon pid)."""
    found = {}
    for line in listing.splitlines():
        if (owner := _OWNER.search(line)) is not None and (handle := _HANDLE.search(line)) is not None:
            found[int(handle.group(1))] = (owner.group(1), int(owner.group(2)))
    return found


def sweep_fences(nft: Nft, tag: str) -> int:
    """Blocking, at the daemon's start: remove what killed daemons left (how many rules). An owned
    table is skipped: its owner is alive (the kernel removes it with its owner). This daemon's plain
    table goes whole; elsewhere the rules of this daemon's earlier runs and of daemons that are gone,
    and a per-daemon table they leave empty."""
    removed = 0
    for table in _TABLES.findall(nft.run("list tables")):
        try:
            listing = nft.run(f"list table inet {table}")
        except NftError:
            continue  # gone meanwhile
        if re.search(r"^\s*flags .*\bowner\b", listing, re.MULTILINE):
            continue
        rules = _rules(listing)
        stale = [h for h, (owner, pid) in rules.items() if owner == tag or not _daemon_alive(pid)]
        if not stale and table != tag:
            continue  # a live daemon's (an idle one's table has no rules)
        try:
            if table == tag or (table != TABLE_LEGACY and len(stale) == len(rules)):
                nft.run(f"delete table inet {table}")
            else:
                for handle in stale:
                    nft.run(f"delete rule inet {table} {CHAIN} handle {handle}")
        except NftError as exc:
            log.warning("fence.sweep_failed", table=table, error=str(exc))
            continue
        removed += len(stale)
    if removed:
        log.info("fence.swept", rules=removed)
    return removed


class Fences:
    """One daemon's table and its rules (one per process and state directory: `fences`)."""

    def __init__(self, tag: str, library: str = DEFAULT_LIBRARY) -> None:
        if not _TAG.match(tag):
            raise ValueError(f"bad daemon tag {tag!r}")
        self.tag = tag
        self.library = library
        self.unavailable = "not opened"  # why no rule can be installed; "" once the table is there
        self.owned = False  # the kernel removes the table with this process (Linux 5.12 and later)
        self._nft: Nft | None = None

    def open(self) -> int:
        """Blocking, at the daemon's start: sweep, then make this daemon's table. Never raises:
        `unavailable` says why fences cannot work. The rules swept."""
        try:
            if os.geteuid() != 0:  # a per-user daemon: nothing to try (nor to load)
                raise FenceError("this daemon is not root: it cannot install firewall rules")
            if self._nft is None:
                self._nft = Nft(self.library)
            swept = sweep_fences(self._nft, self.tag)
            self.owned = self._make_table(self._nft)
        except FenceError as exc:
            self.unavailable = str(exc)
            return 0
        except NftError as exc:
            hint = " (the daemon needs CAP_NET_ADMIN)" if "not permitted" in str(exc) else ""
            self.unavailable = f"nftables: {exc}{hint}"
            return 0
        self.unavailable = ""
        return swept

    def _table(self, owned: bool) -> str:
        flags = " { flags owner; }" if owned else ""
        return (f"add table inet {self.tag}{flags}\n"
                f"add chain inet {self.tag} {CHAIN} {{ type filter hook output priority 0; policy accept; }}\n")

    def _make_table(self, nft: Nft) -> bool:
        try:
            nft.run(self._table(owned=True))
            return True
        except NftError:
            pass  # a kernel without owner tables, or no permission at all: the plain table says which
        try:
            nft.run(self._table(owned=False))
        except NftError as exc:
            raise FenceError(f"nftables refused the table inet {self.tag}: {exc} (the daemon needs "
                             "CAP_NET_ADMIN; or another daemon of this state directory holds it)") from None
        log.warning("fence.table_not_owned", table=self.tag,
                    hint="this kernel has no owner tables (Linux 5.12): a killed daemon's rules stay until a start")
        return False

    def _run(self, commands: str) -> str:
        if self.unavailable or self._nft is None:
            raise FenceError(self.unavailable or "fences are not opened")
        try:
            return self._nft.run(commands)
        except NftError as exc:
            raise FenceError(f"nftables: {exc}") from None

    def install(self, address: str, port: int, uid: int, label: str) -> Fence:
        """Blocking: the rule for `address`:`port`, letting only `uid` and root connect from this host."""
        if not 0 < port < 65536 or not _LABEL.match(label):
            raise FenceError(f"bad fence request: port {port}, label {label!r}")
        rule = rule_text(address, port, {0, uid}, f"{self.tag} p{os.getpid()} {label}")
        out = self._run(self._table(self.owned) + f"add rule inet {self.tag} {CHAIN} {rule}\n")
        for line in out.splitlines():
            if line.startswith("add rule") and (found := _HANDLE.search(line)):
                return Fence(address=address, port=port, handle=int(found.group(1)), table=self.tag)
        raise FenceError(f"nftables did not say which rule it added: {out.strip()[:300]!r}")

    def remove(self, fence: Fence) -> None:
        """Blocking: delete the rule (already gone is fine)."""
        try:
            self._run(f"delete rule inet {fence.table} {CHAIN} handle {fence.handle}")
        except FenceError as exc:
            log.warning("fence.remove_failed", address=fence.address, port=fence.port, handle=fence.handle,
                        error=str(exc))

    def handles(self) -> set[int]:
        """Blocking: the handles of the rules in this daemon's table now (none when it is not there)."""
        try:
            return set(_rules(self._run(f"list table inet {self.tag}")))
        except FenceError:
            return set()

    def close(self) -> None:
        """Blocking: the table and its rules gone (a plain one deleted; an owned one goes with the
        context's socket). Fences are then unavailable."""
        if self._nft is not None:
            if not self.owned and not self.unavailable:
                try:
                    self._nft.run(f"delete table inet {self.tag}")
                except NftError as exc:
                    log.warning("fence.close_failed", table=self.tag, error=str(exc))
            self._nft.close()
            self._nft = None
        self.unavailable = "fences are closed"


_open: dict[str, Fences] = {}
_open_lock = threading.Lock()


def fences(tag: str, library: str = DEFAULT_LIBRARY) -> Fences:
    """Blocking: this process's fences for the daemon `tag`, opened on first use (the daemon opens its
    own at its start, with its configured library)."""
    with _open_lock:
        found = _open.get(tag)
        if found is None:
            found = _open[tag] = Fences(tag, library)
            found.open()
        return found


def require(tag: str) -> None:
    """Blocking, at a multi-node submit: a FenceError saying what is at stake unless the fences of the
    daemon `tag` work."""
    why = fences(tag).unavailable
    if why:
        raise FenceError(f"this daemon cannot fence job ports ({why}): a multi-node job's rendezvous store "
                         "and endpoint would be open to every local user, who could run code as the job's "
                         "user through them; refused (the daemon's operator may set allow_unfenced = true "
                         "to run such jobs unfenced)")


@dataclass(frozen=True)
class PortOwner:
    """Whose port a rule fences: the job's owner, the daemon's tag, the attempt's label, and whether
    the port may be served without its rule (`required`: a multi-node job's, unless allow_unfenced)."""

    uid: int
    tag: str
    label: str
    required: bool = False


def _install(address: str, port: int, owner: PortOwner) -> Fence:
    return fences(owner.tag).install(address, port, owner.uid, owner.label)


async def fence_port(address: str, port: int, owner: PortOwner) -> tuple[Fence | None, str]:
    """The rule for `address`:`port` (None and why not, when it cannot be installed); a FenceError
    instead where the owner requires it."""
    try:
        return await anyio.to_thread.run_sync(_install, address, port, owner), ""
    except FenceError as exc:
        if owner.required:
            raise
        return None, str(exc)


async def unfence(fence: Fence | None) -> None:
    if fence is not None:
        await anyio.to_thread.run_sync(lambda: fences(fence.table).remove(fence))
