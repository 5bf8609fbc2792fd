"""A submitter who stops its own processes mid-launch never freezes the root daemon (round 3, G1).

Bug: the shell gate's launch quotes each `'` of the job's environment as 5 bytes, so an environment
of single quotes made a launch of hundreds of KB, more than a pipe holds. The daemon wrote it with a
blocking write, under the reaper's lock (and for ranks on the event loop's thread), while the
pipe's reader, after `setpriv`, was the user's own dash: the user SIGSTOPped its dash and the
daemon's main thread sat in `pipe_write` for good (root's ping unanswered, no deadline fired).

Here a real root daemon serves a real user whose own "stopper" SIGSTOPs every dash it owns, as
soon as it sees one. Root pings the daemon all along, and every ping is answered within
PING_BOUND; the rank whose start the user stopped fails its job with the join deadline, and
nothing is left. The same start, with the gate stopped before it reads a byte (no race), for
every caller of the gate: tests/integration/test_gate.py.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream

from ddpd.daemon.contain.identity import Identity
from ddpd.protocol import JobSpec, JobState, Timeouts

from ..conftest import REPO, DaemonProc
from ..scripts.userpython import USER_PYTHON
from ..users import plain_env, submit_as
from .test_shared_box import pings, shared_box

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.xdist_group("users"),
    pytest.mark.skipif(os.geteuid() != 0, reason="a shared box needs a root daemon and real users"),
]

TIMEOUT = 120
TRIES = 8
PING_BOUND = 1.0  # seconds: a ping takes milliseconds; a frozen loop answers none
QUOTES = 60_000  # single quotes (the request is at most 64 KB): a shell launch of about 300 KB

# the user's stopper: SIGSTOP every dash of its own uid, in a loop, from the moment it says "ready"
STOPPER = r"""
import os, signal, sys
me, uid = os.getpid(), os.getuid()
print("ready", flush=True)
stopped = set()
while True:
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/comm") as f:
                if f.read().strip() != "dash" or os.stat(f"/proc/{name}").st_uid != uid:
                    continue
            os.kill(int(name), signal.SIGSTOP)
        except OSError:
            continue
        if name not in stopped:
            stopped.add(name)
            print("stopped", name, flush=True)
"""

def quoted_spec(tag: str) -> JobSpec:
    """A one-rank script job whose exported environment is mostly single quotes."""
    environ = plain_env(**{f"Q{tag}": "'" * QUOTES})
    return JobSpec(script=[str(REPO / "tests" / "scripts" / "show_env.py")], nproc=1, workdir="/tmp",
                   python=USER_PYTHON, environ=environ, timeouts=Timeouts(join=8.0, kill_grace=1.0))


class Stops:
    """How many of the user's dash processes its stopper has stopped so far."""

    def __init__(self) -> None:
        self.count = 0


@asynccontextmanager
async def stopper(who: Identity) -> AsyncIterator[Stops]:
    """`who` stops each of its dash processes the moment it sees one, for the block."""
    proc = await anyio.open_process([USER_PYTHON, "-c", STOPPER], user=who.uid, group=who.gid, extra_groups=[],
                                    cwd="/", env={"PATH": "/usr/bin:/bin"})
    stops = Stops()

    async def count(lines: BufferedByteReceiveStream) -> None:
        while True:
            await lines.receive_until(b"\n", 100)
            stops.count += 1

    try:
        assert proc.stdout is not None
        lines = BufferedByteReceiveStream(proc.stdout)
        with anyio.fail_after(30):
            assert await lines.receive_until(b"\n", 100) == b"ready"
        async with anyio.create_task_group() as tg:
            tg.start_soon(count, lines)
            yield stops
            tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            proc.kill()
            await proc.wait()


@asynccontextmanager
async def root_pings(d: DaemonProc) -> AsyncIterator[list[float]]:
    """Root pings the daemon every 50 ms for the block, each within PING_BOUND; the latencies."""
    seen: list[float] = []

    async def ping_forever() -> None:
        while True:
            start = time.monotonic()
            with anyio.fail_after(PING_BOUND):
                await d.client.ping()
            seen.append(time.monotonic() - start)
            await anyio.sleep(0.05)

    async with anyio.create_task_group() as tg:
        tg.start_soon(ping_forever)
        yield seen
        tg.cancel_scope.cancel()


async def test_a_user_stopping_its_gate_mid_launch_freezes_nothing(
    users: tuple[Identity, Identity], public_tmp: Path
) -> None:
    ann, bob = users
    # cold ranks, started through the gate, even in a tier run on a pool (DDPD_TEST_POOL_SIZE's flag
    # outweighed the config's `pool_size = 0`): a rank its key's fork server forks has no gate to
    # stop, and the stopper then stopped a pool server's gate instead, or nothing in 8 tries
    async with shared_box(public_tmp, "", "--pool-size", "0") as d:
        # unstopped, the same launch starts and succeeds (and the interpreter check is remembered)
        spec = quoted_spec("a")
        first = await submit_as(ann, d, spec)
        with anyio.fail_after(TIMEOUT):
            view = await d.client.wait(first)
        assert view.state == JobState.SUCCEEDED, view.root_cause

        async with stopper(ann) as stops, root_pings(d) as latencies:
            # the rank's start: its gate's dash (the user's after setpriv) stopped as it reads the
            # launch; the stopper races the dash, and wins within a few tries (the bug's report: 1-2)
            for _ in range(TRIES):
                before = stops.count
                job = await submit_as(ann, d, spec)
                with anyio.fail_after(TIMEOUT):
                    view = await d.client.wait(job)
                if stops.count > before:
                    assert view.state in (JobState.FAILED, JobState.TIMED_OUT), view.state
                    assert view.root_cause is not None and view.root_cause.rank == 0, view.root_cause
                    print("the stopped rank's job:", view.root_cause)
                    break
            else:
                pytest.fail(f"the stopper never caught a rank's gate in {TRIES} tries")
            await pings(bob, d)
        assert latencies and max(latencies) < PING_BOUND, max(latencies)
