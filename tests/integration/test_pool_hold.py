"""A refill under way when a job takes the last free core is held (its cgroup frozen) until a core is
free again: a real daemon on one core, its workers the scale benchmark's simulated worker behind a
gate the test opens (a FIFO), so that which interpreter is still starting is the test's to say.

The daemon runs under ``taskset -c 0`` (one core, whatever the machine has). Its pool keeps one
interpreter. Job A takes it; while A runs no refill starts (the core is A's); when A ends one does,
and it waits at the gate. Job B then starts (cold: the pool is empty) and holds the core: the
refill is frozen (``cgroup.events`` says so); when B ends it is thawed, passes the gate, and is ready.

Refills that import torch, and so their yielding, are the interpreter pool's own: the daemon runs
with ``pool_fork_server = false`` (a fork server's refills are forks of milliseconds).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest

from ddpd.daemon.contain.cgroups import parse_keyed
from ddpd.daemon.ranklogs.inotify import Inotify
from ddpd.protocol import PROTOCOL_VERSION, JobState

from ..conftest import DaemonProc, running_daemon

pytestmark = pytest.mark.anyio

REPO = Path(__file__).resolve().parents[2]
SIMWORKER = REPO / "benchmarks" / "simworker.sh"
BASH = shutil.which("bash") or "/bin/bash"
WAIT = 60


def gate_script(base: Path) -> Path:
    """A pool worker waits at the FIFO once `hold` exists (a cold rank never does), then becomes the
    simulated worker (same pid)."""
    script = base / "gated-worker.sh"
    script.write_text(f'#!{BASH}\nif [[ " $* " == *" --pool "* && -e {base}/hold ]]; then\n'
                      f'    IFS= read -r _ < {base}/fifo\nfi\nexec {BASH} {SIMWORKER} "$@"\n')
    return script


def events(d: DaemonProc, name: str) -> list[dict[str, Any]]:
    return [e for e in d.logs if e.get("event") == name]


def frozen(cgroup: str) -> bool:
    return parse_keyed((Path(cgroup) / "cgroup.events").read_text()).get("frozen") == "1"


async def wait_frozen(cgroup: str, want: bool) -> None:
    """Until the cgroup's `cgroup.events` says `frozen` is `want`: the write to `cgroup.freeze`
    returns before every task has stopped (a task must run to freeze, and a refill at idle priority
    beside a busy rank may wait for that). The file's inotify event wakes the wait; bounded."""
    ino = Inotify()
    fd = os.open(Path(cgroup) / "cgroup.events", os.O_RDONLY | os.O_CLOEXEC)
    try:
        ino.watch(fd)  # before the first look: a change after it is an event
        with anyio.fail_after(WAIT):
            while frozen(cgroup) != want:
                await anyio.wait_readable(ino.fd)
                ino.read()
    finally:
        os.close(fd)
        ino.close()


async def open_gate(base: Path) -> None:
    """One line into the FIFO: the gated worker waiting there goes on (opening blocks until it reads)."""
    def write() -> None:
        with open(base / "fifo", "w") as fifo:
            fifo.write("go\n")

    with anyio.fail_after(WAIT):
        await anyio.to_thread.run_sync(write, abandon_on_cancel=True)


async def test_a_refill_is_held_while_a_job_holds_the_last_core_and_released_after(short_tmp: Path) -> None:
    if shutil.which("taskset") is None:
        pytest.fail("taskset (util-linux) is needed to give the daemon one core")
    base = short_tmp
    os.mkfifo(base / "fifo")
    script = gate_script(base)
    config = base / "ddpd.toml"
    config.write_text(f'worker_command = ["{BASH}", "{script}", "--protocol", "{PROTOCOL_VERSION}"]\n'
                      "pool_size = 1\npool_fork_server = false\n")
    async with running_daemon(base, "--config", str(config), "--cpu-slots", "1", "--pool-size", "1",
                              prefix=("taskset", "-c", "0")) as d:
        ready = await d.wait_log(lambda e: e.get("event") == "pool.worker_ready", WAIT)
        spec = d.spec(name="holder", task="two-layer", nproc=1, steps=10**9, hot_replace=0)
        a = await d.client.submit(spec)
        await d.wait_log(lambda e: e.get("event") == "pool.worker_taken" and e.get("pid") == ready["pid"], WAIT)
        (base / "hold").touch()  # the refill that starts when A ends waits at the gate (B's cold rank does not)
        await d.client.cancel(a)
        with anyio.fail_after(WAIT):
            assert (await d.client.wait(a)).state == JobState.CANCELLED
        refill = await d.wait_log(lambda e: e.get("event") == "pool.worker_spawned" and e.get("pid") != ready["pid"],
                                  WAIT)
        b = await d.client.submit(spec)
        held = await d.wait_log(lambda e: e.get("event") == "pool.refill_held" and e.get("pid") == refill["pid"],
                                WAIT)
        assert held["busy"] == 1 and held["cores"] == 1
        await wait_frozen(held["cgroup"], True)  # B holds the only core: the refill stops
        status = await d.client.daemon_info()
        assert "1 held until a core is free" in (status.pool_state or ""), status.pool_state
        assert not [e for e in events(d, "pool.worker_ready") if e.get("pid") == refill["pid"]]
        await d.client.cancel(b)
        with anyio.fail_after(WAIT):
            assert (await d.client.wait(b)).state == JobState.CANCELLED
        await d.wait_log(lambda e: e.get("event") == "pool.refill_released" and e.get("pid") == refill["pid"], WAIT)
        await wait_frozen(held["cgroup"], False)
        await open_gate(base)  # thawed, it reads the gate's line and says hello
        await d.wait_log(lambda e: e.get("event") == "pool.worker_ready" and e.get("pid") == refill["pid"], WAIT)
