"""The trust boundary's pure parts: the fence's rule (exactly the address and port bound), the sweep
of what killed daemons left (over a stand-in for libnftables), who holds a local port (read from a
/proc tree written here), which holders a second daemon may join, the agent's frames' bounds, and a
rendezvous that listens only once its rule is in place (and not at all when a required one fails)."""

from __future__ import annotations

import socket
from pathlib import Path

import msgspec
import pytest

from ddpd.daemon.contain import portfence
from ddpd.daemon.contain.nftables import NftError
from ddpd.daemon.contain.portfence import Fence, FenceError, PortOwner, daemon_tag, match_text, rule_text, sweep_fences
from ddpd.daemon.multinode.elastic import Holder, NodeError, check_endpoint, joinable, listening_inodes, port_holders
from ddpd.daemon.run import rendezvous
from ddpd.daemon.run.rendezvous import RendezvousError, open_rendezvous
from ddpd.protocol import JobSpec
from ddpd.protocol.agent import AgentPolled, AgentReply
from ddpd.protocol.framing import Decoder, FrameError

TCP_HEADER = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"


def test_the_rule_refuses_every_local_user_but_the_owner_and_root() -> None:
    text = rule_text("127.0.0.2", 29500, {0, 1001}, "ddpd-abc j1-x/a1")
    assert text == ('ip daddr 127.0.0.2 tcp dport 29500 meta skuid != { 0, 1001 } reject with tcp reset '
                    'comment "ddpd-abc j1-x/a1"')
    assert daemon_tag(Path("/var/lib/ddpd")) != daemon_tag(Path("/var/lib/ddpd2"))  # two daemons, two tags


def test_the_rule_names_exactly_the_address_bound() -> None:
    """Bug (issue 34, finding 2): the rule was `tcp dport P` on every local address, so a job's
    endpoint on 127.0.0.2:P fenced another user's own listener on 127.0.0.1:P."""
    assert match_text("10.0.0.5", 80) == "ip daddr 10.0.0.5 tcp dport 80"
    assert match_text("::1", 80) == "ip6 daddr ::1 tcp dport 80"
    assert match_text("fe80::1%eth0", 80) == "ip6 daddr fe80::1 tcp dport 80"
    assert match_text("::ffff:127.0.0.2", 80) == "ip daddr 127.0.0.2 tcp dport 80"  # reached over IPv4
    assert match_text("0.0.0.0", 80) == "meta nfproto ipv4 tcp dport 80 fib daddr type local"  # a wildcard bind
    assert match_text("::", 80) == "tcp dport 80 fib daddr type local"  # dual-stack: both families
    with pytest.raises(FenceError, match="not an address"):
        match_text("localhost", 80)


TAG, OTHER, GONE = "ddpd-" + "a" * 12, "ddpd-" + "b" * 12, "ddpd-" + "c" * 12
LIVE_PID, DEAD_PID = 100, 200


class FakeNft:
    """libnftables over a ruleset given as text: what `sweep_fences` lists, and the commands it ran."""

    def __init__(self, tables: dict[str, str]) -> None:
        self.tables = tables
        self.ran: list[str] = []

    def run(self, commands: str) -> str:
        if commands == "list tables":
            return "".join(f"table inet {name}\n" for name in self.tables)
        if commands.startswith("list table inet "):
            name = commands.removeprefix("list table inet ")
            if name not in self.tables:
                raise NftError("No such file or directory")
            return self.tables[name]
        self.ran.append(commands)
        return ""


def listing(name: str, owned: bool, *rules: tuple[int, str, int]) -> str:
    lines = [f"table inet {name} {{ # handle 1", "\tflags owner" if owned else "", "\tchain output { # handle 1"]
    lines += [f'\t\tip daddr 127.0.0.1 tcp dport 9 meta skuid != 0 reject with tcp reset comment "{tag} p{pid} '
              f'j1-x/a1" # handle {handle}' for handle, tag, pid in rules]
    return "\n".join([*lines, "\t}", "}"])


def test_a_start_sweeps_what_killed_daemons_left_and_nothing_else(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(portfence, "_daemon_alive", lambda pid: pid == LIVE_PID)
    nft = FakeNft({
        # the table of earlier versions, shared: a rule of this daemon's, a live daemon's, a dead one's
        "ddpd": listing("ddpd", False, (3, TAG, LIVE_PID), (4, OTHER, LIVE_PID), (5, GONE, DEAD_PID)),
        TAG: listing(TAG, False, (7, TAG, DEAD_PID)),  # this daemon's killed run, on a kernel without owner tables
        OTHER: listing(OTHER, True, (8, OTHER, DEAD_PID)),  # owned: its owner is alive whatever the pid says
        GONE: listing(GONE, False, (9, GONE, DEAD_PID)),  # a daemon that is gone
        "ddpd-" + "d" * 12: listing("ddpd-" + "d" * 12, False),  # an idle live daemon's, on an older kernel
    })
    assert sweep_fences(nft, TAG) == 4  # type: ignore[arg-type]
    assert nft.ran == ["delete rule inet ddpd output handle 3", "delete rule inet ddpd output handle 5",
                       f"delete table inet {TAG}", f"delete table inet {GONE}"]


class Recorded:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int, bool]] = []  # address, port, whether the socket listened then


def fake_fence_port(seen: Recorded, fail: str | None = None) -> object:
    async def fence_port(address: str, port: int, owner: PortOwner) -> tuple[Fence | None, str]:
        listening = any(
            s.getsockname() == (address, port) and s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
            for s in SOCKETS if s.fileno() >= 0)
        seen.calls.append((address, port, listening))
        if fail is None:
            return Fence(address, port, 1, "t"), ""
        if owner.required:
            raise FenceError(fail)
        return None, fail
    return fence_port


SOCKETS: list[socket.socket] = []


@pytest.fixture
def watched_binds(monkeypatch: pytest.MonkeyPatch) -> None:
    real = rendezvous.bound

    def bound(host: str, port: int) -> socket.socket:
        sock = real(host, port)
        SOCKETS.append(sock)
        return sock

    monkeypatch.setattr(rendezvous, "bound", bound)
    monkeypatch.setattr(rendezvous, "unfence", _no_unfence)
    SOCKETS.clear()


async def _no_unfence(fence: Fence | None) -> None:
    pass


@pytest.mark.anyio
@pytest.mark.usefixtures("watched_binds")
async def test_the_store_listens_only_once_its_rule_is_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = Recorded()
    monkeypatch.setattr(rendezvous, "fence_port", fake_fence_port(seen))
    rdzv = await open_rendezvous("127.0.0.1", None, PortOwner(1001, TAG, "j1-x/a1"))
    try:
        assert seen.calls == [("127.0.0.1", rdzv.port, False)]  # bound, not yet listening, when fenced
        assert rdzv.listener is not None and rdzv.listener.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
        assert rdzv.fence is not None and rdzv.fence.address == "127.0.0.1"
    finally:
        rdzv.close()


@pytest.mark.anyio
@pytest.mark.usefixtures("watched_binds")
async def test_a_port_that_must_be_fenced_and_cannot_be_is_never_served(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bug (issue 34, finding 3): without nft a multi-node job's store ran unfenced, open to a
    stranger's pickle."""
    seen = Recorded()
    monkeypatch.setattr(rendezvous, "fence_port", fake_fence_port(seen, fail="nft: Operation not permitted"))
    with pytest.raises(RendezvousError, match=r"cannot be fenced to the job's owner .*allow_unfenced = true"):
        await open_rendezvous("127.0.0.1", None, PortOwner(1001, TAG, "j1-x/a1", required=True))
    assert [s.fileno() for s in SOCKETS] == [-1]  # closed, never listening
    rdzv = await open_rendezvous("127.0.0.1", None, PortOwner(1001, TAG, "j1-x/a2"))  # a single-node job's
    try:
        assert rdzv.fence is None and rdzv.unfenced == "nft: Operation not permitted"
    finally:
        rdzv.close()


def fake_proc(tmp: Path, tcp: str, tcp6: str, procs: dict[int, tuple[int, str, bytes, int]]) -> Path:
    """A /proc with net/tcp{,6} and processes: pid -> (uid, cmdline, environ, inode it holds)."""
    (tmp / "net").mkdir()
    (tmp / "net" / "tcp").write_text(TCP_HEADER + tcp)
    (tmp / "net" / "tcp6").write_text(TCP_HEADER + tcp6)
    for pid, (uid, cmdline, environ, inode) in procs.items():
        d = tmp / str(pid)
        (d / "fd").mkdir(parents=True)
        (d / "status").write_text(f"Name:\tpython\nPPid:\t7\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n")
        (d / "cmdline").write_bytes(cmdline.replace(" ", "\0").encode())
        (d / "environ").write_bytes(environ)
        (d / "fd" / "3").symlink_to(f"socket:[{inode}]")
    return tmp


def test_the_holder_of_a_local_port_is_read_from_proc(tmp_path: Path) -> None:
    # 127.0.0.1:29400 listening (inode 111), the wildcard ::, port 29401 (inode 222), one connected socket
    tcp = ("   0: 0100007F:72D8 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1001 0 111 1\n"
           "   1: 0100007F:72D8 0100007F:9C40 01 00000000:00000000 00:00000000 00000000  1001 0 999 1\n")
    tcp6 = "   0: 00000000000000000000000000000000:72D9 00000000000000000000000000000000:0000 0A 0 0 0 0 0 222 1\n"
    proc = fake_proc(tmp_path, tcp, tcp6, {
        40: (1001, "python -m ddpd.worker --fd 5 --parent 7 --agent", b"A=1\0DDPD_RDZV=run\0", 111),
        41: (1002, "python listen.py", b"", 222)})
    assert listening_inodes("127.0.0.1", 29400, proc) == {111}
    assert listening_inodes("127.0.0.1", 29401, proc) == {222}  # held on every address
    agent = Holder(pid=40, uid=1001, ppid=7, run_id="run", agent=True)
    assert port_holders("127.0.0.1", 29400, proc) == [agent]
    assert agent.describe() == "the daemon with pid 7 (its rendezvous agent, pid 40)"
    assert port_holders("127.0.0.1", 29402, proc) == []


def test_only_an_agent_of_the_same_user_and_run_is_joined() -> None:
    agent = Holder(pid=40, uid=1001, ppid=7, run_id="run", agent=True)
    assert joinable([agent], 1001, "run")
    assert not joinable([agent], 1002, "run")  # another user's rendezvous, whatever it claims
    assert not joinable([agent], 1001, "other")
    assert not joinable([Holder(pid=41, uid=1001, ppid=1, run_id="run", agent=False)], 1001, "run")
    assert not joinable([agent, Holder(pid=42, uid=1002, ppid=1, run_id=None, agent=False)], 1001, "run")
    assert not joinable([], 1001, "run")


def test_a_wildcard_endpoint_is_refused_at_submit() -> None:
    for host in ("0.0.0.0", "[::]"):
        with pytest.raises(NodeError, match="no address the other nodes can reach"):
            check_endpoint(JobSpec(nnodes="2", rdzv_endpoint=f"{host}:29400", rdzv_id="r"))


def test_a_port_held_by_another_process_names_it_at_submit() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(NodeError, match=rf"port {port} on 127.0.0.1 is taken by pid \d+ \(uid 0\)"):
            check_endpoint(JobSpec(nnodes="2", rdzv_endpoint=f"127.0.0.1:{port}", rdzv_id="r"))


def test_the_agents_replies_are_bounded() -> None:
    decoder: Decoder[AgentReply] = Decoder(AgentReply)
    ok = decoder.decode_frame(b'{"type":"polled","id":3,"beats":[1,null],"records":[null,null],"failed":"x"}')
    assert isinstance(ok, AgentPolled) and ok.beats == [1, None]
    too_long = msgspec.json.encode({"type": "polled", "id": 3, "beats": [], "records": [], "failed": "x" * 70000})
    with pytest.raises(FrameError):
        decoder.decode_frame(too_long)
    with pytest.raises(FrameError):
        decoder.decode_frame(b'{"type":"formed","id":1,"node_rank":-1,"nnodes":1,"records":[]}')


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
