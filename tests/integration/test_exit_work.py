"""A script's exit work under ddpd is what it is under torchrun (and `python`): non-daemon threads
joined, atexit handlers run, open files flushed and closed, logging's buffers written; its forked
children do not hold the rank's channel; its ranks get the submitter's umask.

Each case runs the same script under torchrun and as a ddpd job (cold and pooled ranks) and
compares the files both leave, byte for byte.
"""

from __future__ import annotations

import gzip
import os
import subprocess
from pathlib import Path

import anyio
import pytest

from ddpd.protocol import JobState

from ..conftest import DaemonProc
from ..scripts.helpers import SCRIPTS
from .test_script_mode import TORCHRUN

pytestmark = pytest.mark.anyio


def _files(out: Path) -> dict[str, bytes]:
    found = {}
    for p in sorted(out.iterdir()):
        data = p.read_bytes()
        found[p.name] = gzip.decompress(data) if p.suffix == ".gz" else data
    return found


async def _torchrun(script: str, *args: str, umask: int = 0o022) -> int:
    old = os.umask(umask)
    try:
        with anyio.fail_after(120):
            done = await anyio.run_process([TORCHRUN, "--standalone", "--nproc-per-node=2", script, *args],
                                           check=False, stdin=subprocess.DEVNULL)
    finally:
        os.umask(old)
    return done.returncode


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "pooled"])
async def test_exit_work_is_done_as_under_torchrun(daemon: DaemonProc, tmp_path: Path, warm: bool) -> None:
    """Bug: the rank left with os._exit right after the script: the CSV was 0 bytes, the atexit and
    uploader files missing, the MemoryHandler's records lost, and the job SUCCEEDED."""
    ref, ours = tmp_path / "torchrun", tmp_path / "ddpd"
    ref.mkdir()
    ours.mkdir()
    assert await _torchrun(str(SCRIPTS / "exit_work.py"), str(ref)) == 0
    spec = daemon.spec(script=[str(SCRIPTS / "exit_work.py"), str(ours)], nproc=2)
    if warm:  # a first job of the same shape leaves the pool with interpreters of this key
        scratch = tmp_path / "scratch"
        scratch.mkdir()
        await daemon.run(daemon.spec(script=[str(SCRIPTS / "exit_work.py"), str(scratch)], nproc=2))
    view = await daemon.run(spec)
    assert view.state == JobState.SUCCEEDED, view.root_cause
    expected = _files(ref)
    assert len(expected[next(k for k in expected if k.startswith("losses-"))].splitlines()) == 101
    assert _files(ours) == expected


def _modes(out: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mode & 0o777 for p in sorted(out.iterdir())}


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "pooled"])
async def test_ranks_run_with_the_submitters_umask(daemon: DaemonProc, tmp_path: Path, warm: bool) -> None:
    """Bug: every rank ran at umask 077 (cgroups on) or the daemon's own (off), so what a job made was
    0600/0700 even from a 027 shell whose team shares a group directory; torchrun gives the shell's."""
    ref, ours = tmp_path / "torchrun", tmp_path / "ddpd"
    ref.mkdir()
    ours.mkdir()
    assert await _torchrun(str(SCRIPTS / "show_umask.py"), str(ref), umask=0o027) == 0
    if warm:
        await daemon.run(daemon.spec(task="two-layer", nproc=2, steps=1))
    old = os.umask(0o027)
    try:  # the client sends the submitter's umask with the spec
        spec = daemon.spec(script=[str(SCRIPTS / "show_umask.py"), str(ours)], nproc=2)
        job = await daemon.client.submit(spec)
    finally:
        os.umask(old)
    with anyio.fail_after(120):
        view = await daemon.client.wait(job)
    assert view.state == JobState.SUCCEEDED, view.root_cause
    assert _modes(ours) == _modes(ref) == {"dir-0": 0o750, "dir-1": 0o750, "file-0": 0o640, "file-1": 0o640}


async def test_a_failing_rank_does_its_exit_work_and_its_own_exit_is_the_root_cause(
    daemon: DaemonProc, tmp_path: Path
) -> None:
    """Bug: the failure frame tore the job down at once, so the failing rank's atexit handlers could
    be cut short by the teardown's SIGTERM, and the root cause then read "signal SIGTERM". Bug: a
    rank that had sent its failure still counted as joined, so "all ranks joined" (RUNNING) could be
    recorded after rank.failed."""
    ref, ours = tmp_path / "torchrun", tmp_path / "ddpd"
    ref.mkdir()
    ours.mkdir()
    assert await _torchrun(str(SCRIPTS / "fails_with_exit_work.py"), str(ref)) != 0
    view = await daemon.run(daemon.spec(script=[str(SCRIPTS / "fails_with_exit_work.py"), str(ours)], nproc=2))
    assert view.state == JobState.FAILED
    cause = view.root_cause
    assert cause is not None and (cause.rank, cause.exit_code, cause.signal) == (1, 1, None), cause
    assert cause.error == "RuntimeError" and cause.message == "rank 1 gives up", cause
    assert _files(ours) == _files(ref) == {"atexit-1.txt": b"atexit ran\n"}
    # events in causal order: once a rank has failed, the job is never recorded RUNNING after it
    events = [e async for e in daemon.client.events(view.id)]
    failed_at = next(i for i, e in enumerate(events) if e.kind == "rank.failed")
    later = [e.data for e in events[failed_at:] if e.kind == "job.state_changed"]
    assert later and all(d["to"] != JobState.RUNNING.value for d in later), later
