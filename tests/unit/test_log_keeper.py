"""The keeper of an attempt's rank logs on real files: a rank that writes nothing is never looked at
(inotify), one that writes is indexed within a tick and rotated past its limit (a journal event),
a rank's last look stamps what it wrote last, and where no watch can be had every rank is polled."""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest

from ddpd.daemon.ranklogs import keeper as keeper_mod
from ddpd.daemon.ranklogs.keeper import LogKeeper, Watched
from ddpd.daemon.ranklogs.logindex import LiveStream, RankLogs, decode
from ddpd.daemon.store.bus import EventBus
from ddpd.daemon.store.journal import Journal
from ddpd.daemon.store.records import Job
from ddpd.daemon.store.state import StateDB
from ddpd.protocol import JobSpec, JobState

pytestmark = pytest.mark.anyio

RANKS = 100
WAIT = 10.0


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[Journal]:
    db = StateDB(tmp_path / "ddpd.db")
    yield Journal(db, EventBus())
    db.close()


def make_job() -> Job:
    return Job(id="j1-abcd", seq=1, name="t", owner_uid=0, spec=JobSpec(task="two-layer", nproc=RANKS),
               state=JobState.RUNNING, submitted_at=time.time())


class Rank:
    """One rank's two logs: the writer's fds (as the rank's stdout and stderr) and the daemon's side."""

    def __init__(self, base: Path, r: int) -> None:
        self.paths = [base / f"rank-{r}.log", base / f"rank-{r}.err"]
        self.writers = [os.open(p, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600) for p in self.paths]
        streams = [LiveStream(log=str(p), fd=os.open(f"/proc/self/fd/{w}", os.O_RDWR),
                              index_fd=os.open(f"{p}.idx", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600))
                   for p, w in zip(self.paths, self.writers, strict=True)]
        self.logs = RankLogs(streams)

    def index(self, stream: int = 0) -> list[int]:
        return list(decode(Path(f"{self.paths[stream]}.idx").read_bytes()).offsets)

    def close(self) -> None:
        self.logs.close()
        for fd in self.writers:
            os.close(fd)


@asynccontextmanager
async def kept(journal: Journal, ranks: list[Rank], max_bytes: int = 1 << 30) -> AsyncIterator[
        tuple[LogKeeper, list[Watched]]]:
    keeper = LogKeeper(journal, make_job(), 1)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(keeper.run)
            yield keeper, [keeper.add(i, r.logs, max_bytes) for i, r in enumerate(ranks)]
            tg.cancel_scope.cancel()
    finally:
        keeper.close()
        for r in ranks:
            r.close()


async def until(cond: object) -> None:
    """A bounded wait for what the keeper does on its own task (no sleep orders anything)."""
    assert callable(cond)
    with anyio.fail_after(WAIT):
        while True:
            if cond():
                return
            await anyio.sleep(0.01)


async def test_only_the_rank_that_wrote_is_looked_at_and_its_rotation_is_told(tmp_path: Path,
                                                                              journal: Journal) -> None:
    ranks = [Rank(tmp_path, r) for r in range(RANKS)]
    events = journal.bus.subscribe()
    async with kept(journal, ranks, max_bytes=64 * 1024) as (keeper, _):
        await until(lambda: keeper.ranks_looked == RANKS)  # each once, as it was added: that look is over
        os.write(ranks[7].writers[0], b"hello\n")
        await until(lambda: keeper.ranks_looked > RANKS)  # counted once the look is over: indexed by then
        assert ranks[7].index() == [6]
        assert keeper.ranks_looked == RANKS + 1  # a polling keeper would have looked at all of them again
        assert all(r.index(s) == [] for r in ranks for s in (0, 1) if (r, s) != (ranks[7], 0))

        os.write(ranks[3].writers[1], b"x" * 99 + b"\n" * 1 + b"y" * 100_000 + b"\n")  # past the limit
        with anyio.fail_after(WAIT):
            event = await events.receive()
        assert (event.kind, event.rank, event.data["stream"]) == ("rank.log_rotated", 3, "stderr")
        assert (await anyio.Path(f"{ranks[3].paths[1]}.1").stat()).st_size == event.data["kept"] > 0
        assert keeper.ranks_looked <= RANKS + 3  # rank 7, rank 3 (perhaps twice: its truncation is a write too)


async def test_what_a_rank_wrote_before_its_watch_is_indexed_too(tmp_path: Path, journal: Journal) -> None:
    ranks = [Rank(tmp_path, r) for r in range(2)]
    os.write(ranks[1].writers[0], b"early\n")  # a warning at the interpreter's start, say
    async with kept(journal, ranks):
        await until(lambda: ranks[1].index() == [6])  # no write since: the first look found it


async def test_a_ranks_last_look_stamps_what_it_wrote_last(tmp_path: Path, journal: Journal) -> None:
    ranks = [Rank(tmp_path, r) for r in range(2)]
    async with kept(journal, ranks) as (keeper, watched):
        os.write(ranks[1].writers[1], b"last words\n")
        await keeper.final(watched[1])  # as when the rank has exited: at once, whatever the tick
        assert ranks[1].index(1) == [11]
        os.write(ranks[1].writers[1], b"after\n")  # no longer watched
        os.write(ranks[0].writers[0], b"still\n")
        await until(lambda: ranks[0].index() == [6])
        assert ranks[1].index(1) == [11]


class NoWatches(keeper_mod.Inotify):
    def watch(self, fd: int) -> int:
        raise OSError(28, "inotify_add_watch: No space left on device")


async def test_without_watches_every_rank_is_polled(tmp_path: Path, journal: Journal,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(keeper_mod, "Inotify", NoWatches)  # the user's watch limit, reached
    ranks = [Rank(tmp_path, r) for r in range(3)]
    async with kept(journal, ranks) as (keeper, watched):
        assert all(w.polled for w in watched)
        os.write(ranks[2].writers[0], b"polled\n")
        await until(lambda: ranks[2].index() == [7])
        assert keeper.ranks_looked >= 3  # every rank, each tick
