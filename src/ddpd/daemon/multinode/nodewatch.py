"""Whether the other nodes of a multi-node attempt are alive, judged on this daemon's own clock.

Every daemon of an attempt adds to its heartbeat counter in the rendezvous store each interval and
reads the others'. `NodeWatch` keeps, per peer, the last counter value and when (on this daemon's
monotonic clock) it last changed: a counter unchanged for `keep_alive` seconds is a lost node. No
clock of another machine is ever compared with ours. A store that has not answered for
`keep_alive` seconds is reported as unreachable (the daemon hosting it is gone, or the network).
A failure another node wrote into the store wins over both (it names the root cause).

Pure logic: the caller feeds it what it read and the time it read it (`beat`, `answered`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Verdict:
    kind: str  # "lost", "unreachable" or "failed" (and "waiting", from the rendezvous, in NodeSession.poll)
    node: int | None = None  # the lost node's rank (lost); how many nodes wait to join (waiting)
    detail: str = ""  # the text another node wrote (failed)


@dataclass
class NodeWatch:
    keep_alive: float
    peers: list[int]
    started: float  # when watching began (a peer gets keep_alive from then to beat once)
    last_value: dict[int, int] = field(default_factory=dict)
    last_change: dict[int, float] = field(default_factory=dict)
    last_answer: float | None = None
    failure: str | None = None

    def answered(self, now: float) -> None:
        """The store answered a read at `now`."""
        self.last_answer = now

    def beat(self, node: int, counter: int, now: float) -> None:
        """`node`'s heartbeat counter read at `now`."""
        if self.last_value.get(node) != counter:
            self.last_value[node] = counter
            self.last_change[node] = now

    def failed(self, text: str) -> None:
        """Another node wrote why its attempt failed."""
        if self.failure is None:
            self.failure = text

    def verdict(self, now: float) -> Verdict | None:
        """What ends the attempt now, if anything: a written failure, the store silent, a peer silent."""
        if self.failure is not None:
            return Verdict("failed", detail=self.failure)
        if now - (self.last_answer if self.last_answer is not None else self.started) >= self.keep_alive:
            return Verdict("unreachable")
        # a peer is lost when the store kept answering and its counter did not move: judged up to the
        # last answer, not up to now (a store that stopped answering says nothing of the peers; bug: a
        # cut link read "node 0 lost" on the cut-off node, whose last reads were up to a beat newer
        # than node 0's last change, before the store's silence reached keep_alive)
        seen = self.last_answer if self.last_answer is not None else self.started
        for node in self.peers:
            if seen - self.last_change.get(node, self.started) >= self.keep_alive:
                return Verdict("lost", node=node)
        return None
