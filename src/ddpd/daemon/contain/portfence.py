"""Port fences: only a job's owner (and root) on this host can connect to the job's store ports.

Each port a job's store or rendezvous endpoint listens on gets one nftables rule in ddpd's own
table (``inet ddpd``, chain ``output``, hooked on locally generated traffic): a TCP connection
to that port on any of this host's addresses (``fib daddr type local``) from a socket whose owner
(``meta skuid``) is neither the job's user nor root is refused with a reset. The rule is installed
after the daemon binds the port and before any process of the job starts, and removed with the
attempt (or the job's rendezvous). Connections from other machines are not this rule's business
(see docs/multinode.md for what a multi-node job must trust).

Each rule carries a comment naming its daemon (a tag derived from the state directory, so two
daemons on one host never touch each other's rules, and its pid) and its job; `sweep` removes, at
the daemon's start, a previous run's leftovers and the rules of daemons that are gone. Where
``nft`` is missing or refuses (no CAP_NET_ADMIN, no nf_tables, not root), `FenceError` says why;
the attempt reports it as a job event and goes on unfenced.

Blocking calls (they run ``nft``): call them from a thread.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import anyio.to_thread
import structlog

log = structlog.get_logger("ddpd")

TABLE = "ddpd"
CHAIN = "output"
NFT_TIMEOUT = 10.0
_HANDLE = re.compile(r"# handle (\d+)\s*$")
_LABEL = re.compile(r"^[A-Za-z0-9._:/-]{1,64}$")
_OWNER = re.compile(r'comment "(ddpd-[0-9a-f]+) p(\d+) ')  # the daemon's tag and pid


class FenceError(RuntimeError):
    """The rule could not be installed (the text says why)."""


def daemon_tag(state_dir: Path) -> str:
    """This daemon's mark on its rules: the same across its restarts, another daemon's differs."""
    return "ddpd-" + hashlib.sha256(str(state_dir.resolve()).encode()).hexdigest()[:12]


def _nft(*args: str, script: str | None = None) -> str:
    if os.geteuid() != 0:  # a per-user daemon: no nft call can succeed (nor cost a process start)
        raise FenceError("this daemon is not root: it cannot install firewall rules")
    exe = shutil.which("nft")
    if exe is None:
        raise FenceError("nft is not installed (install nftables to fence job ports)")
    try:
        done = subprocess.run([exe, *args], input=script, capture_output=True, text=True, timeout=NFT_TIMEOUT,
                              check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise FenceError(f"nft did not run: {exc}") from None
    if done.returncode != 0:
        raise FenceError(f"nft failed: {(done.stderr or done.stdout).strip()[:500]}")
    return done.stdout


def rule_text(port: int, uids: set[int], comment: str) -> str:
    """The rule (after ``add rule inet ddpd output``): refuse local connections to `port` from
    sockets of any user but `uids`."""
    allowed = ", ".join(str(u) for u in sorted(uids))
    return (f"tcp dport {port} fib daddr type local meta skuid != {{ {allowed} }} "
            f'reject with tcp reset comment "{comment}"')


@dataclass
class Fence:
    """One installed rule."""

    port: int
    handle: int

    def remove(self) -> None:
        """Blocking: delete the rule (already gone is fine)."""
        try:
            _nft("delete", "rule", "inet", TABLE, CHAIN, "handle", str(self.handle))
        except FenceError as exc:
            log.warning("fence.remove_failed", port=self.port, handle=self.handle, error=str(exc))


def install(port: int, uid: int, tag: str, label: str) -> Fence:
    """Blocking: the rule for `port`, letting only `uid` and root connect from this host."""
    if not 0 < port < 65536 or not _LABEL.match(label) or not _LABEL.match(tag):
        raise FenceError(f"bad fence request: port {port}, label {label!r}")
    script = (f"add table inet {TABLE}\n"
              f"add chain inet {TABLE} {CHAIN} {{ type filter hook output priority 0; policy accept; }}\n"
              f"add rule inet {TABLE} {CHAIN} {rule_text(port, {0, uid}, f'{tag} p{os.getpid()} {label}')}\n")
    out = _nft("--echo", "--handle", "-f", "-", script=script)
    for line in out.splitlines():
        if line.startswith("add rule") and (found := _HANDLE.search(line)):
            return Fence(port=port, handle=int(found.group(1)))
    raise FenceError(f"nft did not say which rule it added: {out.strip()[:300]!r}")


def rules(tag: str | None = None) -> dict[int, str]:
    """Blocking: the rules of the daemon tagged `tag` (every ddpd rule: None) now, by handle (none
    when the table is not there)."""
    try:
        out = _nft("--handle", "list", "chain", "inet", TABLE, CHAIN)
    except FenceError:
        return {}
    found = {}
    for line in out.splitlines():
        owner = _OWNER.search(line)
        if owner is not None and tag in (None, owner.group(1)) and (match := _HANDLE.search(line)):
            found[int(match.group(1))] = line.strip()
    return found


def _daemon_alive(pid: int) -> bool:
    try:
        return b"ddpd" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def sweep(tag: str) -> int:
    """Blocking, at the daemon's start: remove the rules a previous run of this daemon left, and
    those of any daemon that is gone (killed, its state directory never served again)."""
    left = [handle for handle, line in rules().items()
            if (owner := _OWNER.search(line)) is not None
            and (owner.group(1) == tag or not _daemon_alive(int(owner.group(2))))]
    for handle in left:
        Fence(port=0, handle=handle).remove()
    if left:
        log.info("fence.swept", rules=len(left))
    return len(left)


@dataclass(frozen=True)
class PortOwner:
    """Whose port a rule fences: the job's owner, the daemon's tag, the attempt's label."""

    uid: int
    tag: str
    label: str


async def fence_port(port: int, owner: PortOwner) -> tuple[Fence | None, str]:
    """The rule for `port` (None and why not, when it cannot be installed)."""
    try:
        return await anyio.to_thread.run_sync(install, port, owner.uid, owner.tag, owner.label), ""
    except FenceError as exc:
        return None, str(exc)


async def unfence(fence: Fence | None) -> None:
    if fence is not None:
        await anyio.to_thread.run_sync(fence.remove)
