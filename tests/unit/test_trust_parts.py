"""The trust boundary's pure parts: the fence's rule, who holds a local port (read from a /proc
tree written here), which holders a second daemon may join, the agent's frames' bounds, and a
rendezvous that drops the connections queued before its fence."""

from __future__ import annotations

import socket
from pathlib import Path

import msgspec
import pytest

from ddpd.daemon.contain.portfence import daemon_tag, rule_text
from ddpd.daemon.multinode.elastic import Holder, NodeError, check_endpoint, joinable, listening_inodes, port_holders
from ddpd.daemon.run.rendezvous import drop_queued
from ddpd.protocol import JobSpec
from ddpd.protocol.agent import AgentPolled, AgentReply
from ddpd.protocol.framing import Decoder, FrameError

TCP_HEADER = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"


def test_the_rule_refuses_every_local_user_but_the_owner_and_root() -> None:
    text = rule_text(29500, {0, 1001}, "ddpd-abc j1-x/a1")
    assert text == ('tcp dport 29500 fib daddr type local meta skuid != { 0, 1001 } reject with tcp reset '
                    'comment "ddpd-abc j1-x/a1"')
    assert daemon_tag(Path("/var/lib/ddpd")) != daemon_tag(Path("/var/lib/ddpd2"))  # two daemons, two tags


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


def test_connections_queued_before_the_fence_are_dropped() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        early = [socket.create_connection(listener.getsockname()) for _ in range(3)]
        try:
            assert drop_queued(listener) == 3
            assert drop_queued(listener) == 0
            assert listener.getblocking()
            for s in early:
                s.settimeout(5)
                assert s.recv(1) == b""  # closed by the daemon's side
        finally:
            for s in early:
                s.close()
