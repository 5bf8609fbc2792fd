"""The differential harness: one script launched three ways at once, `torchrun --standalone
--nproc-per-node 2 SCRIPT ARGS` and `ddpctl submit --nproc 2 --follow -- SCRIPT ARGS` to a pooled and
to a cold daemon, each from a directory of its own (the job's working directory) with the same
environment and umask, and what each launch ended as, for the tests to compare.

What is compared: the exit status (torchrun's against ddpctl's, 0 or 1 both, and a failure's root
cause: rank, exit code, error), the `RESULT ...` lines the ranks print, the bytes of every file the
script wrote under `out/` (modes too where a test asks), and what was left: no process of a launch
may outlive it (those carrying its mark in their environment; a job's ranks and process groups), and
ddpd must not have had to kill any (`job.leftover_killed`). The pooled launch waits until the pool can give
its two ranks without a cold start (a ready fork server, the default; or two ready interpreters)
and its ranks must all have been pooled. Every wait is bounded; a launch that overruns is
killed (its whole session) and fails the test.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
import pickle
import re
import select
import signal
import stat
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import pytest

from ddpd.protocol import JobState
from ddpd.protocol.control import JobView

from ..conftest import DaemonProc, assert_nothing_left, describe, processes_with_env
from ..integration.test_pool import pool_can_give

SCRIPTS = Path(__file__).resolve().parent / "scripts"
BIN = Path(sys.executable).parent
DDPCTL = str(BIN / "ddpctl")
TORCHRUN = [str(BIN / "torchrun")] if (BIN / "torchrun").exists() else [sys.executable, "-m", "torch.distributed.run"]
NPROC = 2
LAUNCH_TIMEOUT = 240.0  # one launch, start to end: a framework's import is seconds of CPU on a loaded 2-core box
# a process of a launch that ends on its own this soon after the launch (spawn's resource tracker, which
# leaves when the last process holding its pipe has gone) was not left behind
LEFT_GRACE = 5.0
MARK = "DDPD_CONFORMANCE_RUN"  # in the environment of every launch (and so of every process it starts)
LAUNCHERS = ("torchrun", "pooled", "cold")
_RESULT = re.compile(r"RESULT rank=\d+(?: \w+=[^\s=]+?)*(?=RESULT |\s|$)")


@dataclass
class Failure:
    """A failed launch's root cause: the rank, its exit code, and the error it raised."""

    rank: int | None
    exit_code: int | None
    error: str | None = None  # "ValueError: bad batch on rank 1"


@dataclass
class Outcome:
    launcher: str
    status: int  # torchrun's exit status, or `ddpctl submit --follow`'s
    results: list[str]
    files: dict[str, str]  # path under out/ -> "N bytes, L lines, sha256 H" (what the comparison shows)
    modes: dict[str, str]  # path under out/ (directories too) -> "0644"
    leftovers: list[str]
    failure: Failure | None = None
    output: str = ""  # the launcher's stderr (torchrun) or the ranks' logs (ddpd), for messages
    job: JobView | None = None
    pooled: list[bool] = field(default_factory=list)  # ddpd: each rank's `rank.spawned` said pooled


@dataclass
class Daemons:
    pooled: DaemonProc  # the default configuration: warm pool on
    cold: DaemonProc  # --pool-size 0: every rank a fresh interpreter


def need(module: str) -> None:
    """Skip where a framework of the `conformance` extra is missing. Found, not imported: importing
    one here would change this process's environment (lightning sets TORCH* variables), and with it
    the launches' (a pooled daemon's ranks would then start cold: another pool key)."""
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed: pip install -e '.[conformance]' (make conformance)")


def result_lines(text: str) -> list[str]:
    """The `RESULT rank=N key=value...` lines in `text`, sorted; torchrun's ranks share one stdout, so a
    line may run into the next rank's (each print is one write, its newline sometimes another)."""
    return sorted(_RESULT.findall(text))


def _digest(path: Path) -> str:
    data = path.read_bytes()
    if path.name == ".metadata" and (path.parent / "__0_0.distcp").exists():
        return _dcp_metadata_digest(path, data)
    lines = data.count(b"\n")
    return f"{len(data)} bytes, {lines} lines, sha256 {hashlib.sha256(data).hexdigest()[:16]}"


def _dcp_metadata_digest(path: Path, data: bytes) -> str:
    """A DCP checkpoint's metadata less the ids each save (and each read) draws afresh (uuid4: two
    saves of the same state by the same launcher differ there and nowhere else)."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(path.parent)).read_metadata()
    if meta.storage_meta is not None:
        ids = dataclasses.replace(meta.storage_meta, save_id="", load_id=None)
        meta = dataclasses.replace(meta, storage_meta=ids)
    content = hashlib.sha256(pickle.dumps(meta)).hexdigest()[:16]
    return f"DCP metadata of {len(data)} bytes, sha256 of its content {content}"


def snapshot(out: Path) -> tuple[dict[str, str], dict[str, str]]:
    files: dict[str, str] = {}
    modes: dict[str, str] = {}
    for path in sorted(out.rglob("*")):
        rel = str(path.relative_to(out))
        modes[rel] = f"{stat.S_IMODE(path.lstat().st_mode):04o}"
        if path.is_file():
            files[rel] = _digest(path)
    return files, modes


def _torchrun_failure(stderr: str) -> Failure | None:
    """The root cause torchrun's failure report names (its rank, exit code and the error's last line)."""
    _, found, report = stderr.partition("Root Cause (first observed failure):")
    if not found:
        return None
    rank = re.search(r"rank\s+: (\d+)", report)
    code = re.search(r"exitcode\s+: (-?\d+)", report)
    errors = re.findall(r"^\s*(\w+(?:Error|Exception|Exit)\b.*)$", report.split("=" * 20)[0], re.MULTILINE)
    return Failure(int(rank.group(1)) if rank else None, int(code.group(1)) if code else None,
                   errors[-1].strip() if errors else None)


def _ddpd_failure(job: JobView) -> Failure | None:
    cause = job.root_cause
    if job.state == JobState.SUCCEEDED or cause is None:
        return None
    error = f"{cause.error}: {cause.message}" if cause.error else None
    return Failure(cause.rank, cause.exit_code, error)


async def _run(argv: list[str], cwd: Path, env: dict[str, str], umask: int) -> tuple[int, str, str]:
    """Run a launcher in a session of its own; past LAUNCH_TIMEOUT its whole session is killed."""
    chunks: dict[str, list[bytes]] = {"stdout": [], "stderr": []}
    async with await anyio.open_process(argv, cwd=str(cwd), env=env, umask=umask, start_new_session=True,
                                        stdin=subprocess.DEVNULL) as proc:

        async def drain(name: str) -> None:
            stream = getattr(proc, name)
            assert stream is not None
            async for data in stream:
                chunks[name].append(data)

        try:
            with anyio.fail_after(LAUNCH_TIMEOUT):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(drain, "stdout")
                    tg.start_soon(drain, "stderr")
                rc = await proc.wait()
        except BaseException:
            with anyio.CancelScope(shield=True):
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                await proc.wait()
            raise
    return rc, b"".join(chunks["stdout"]).decode(errors="replace"), b"".join(chunks["stderr"]).decode(errors="replace")


def _launch_env(run_id: str) -> dict[str, str]:
    return {**os.environ, MARK: run_id}


async def _left_by(run_id: str) -> list[str]:
    """Processes that carry this launch's mark and outlive it by more than LEFT_GRACE (each waited on
    through a pidfd); killed here (they are this test's), named."""
    left: list[int] = []
    fds: dict[int, int] = {}
    for pid in processes_with_env(MARK, {run_id}):
        try:
            fds[pid] = os.pidfd_open(pid)
        except ProcessLookupError:
            pass
    try:
        with anyio.move_on_after(LEFT_GRACE):
            for fd in fds.values():
                await anyio.wait_readable(fd)  # readable: the process has ended
        left = [pid for pid, fd in fds.items() if not _ended(fd)]
    finally:
        for fd in fds.values():
            os.close(fd)
    named = [f"{pid}: {describe(pid)}" for pid in left]
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return named


def _ended(pidfd: int) -> bool:
    return bool(select.select([pidfd], [], [], 0)[0])


async def run_torchrun(script: str, args: list[str], rundir: Path, umask: int) -> Outcome:
    run_id = uuid.uuid4().hex
    argv = [*TORCHRUN, "--standalone", f"--nproc-per-node={NPROC}", str(SCRIPTS / script), *args]
    rc, stdout, stderr = await _run(argv, rundir, _launch_env(run_id), umask)
    files, modes = snapshot(rundir / "out")
    return Outcome("torchrun", rc, result_lines(stdout), files, modes, await _left_by(run_id),
                   _torchrun_failure(stderr) if rc else None, output=stderr[-4000:])


async def run_ddpd(d: DaemonProc, launcher: str, script: str, args: list[str], rundir: Path, umask: int) -> Outcome:
    """`ddpctl submit --nproc 2 --follow -- SCRIPT ARGS` from a shell in `rundir` (its working directory,
    environment and umask are the job's), then what the daemon says of the job."""
    if launcher == "pooled":
        await pool_can_give(d, NPROC)  # the ranks are pooled, not cold ones started because none was ready
    run_id = uuid.uuid4().hex
    argv = [DDPCTL, "--socket", str(d.socket), "submit", "--nproc", str(NPROC), "--follow", "--",
            str(SCRIPTS / script), *args]
    rc, stdout, stderr = await _run(argv, rundir, _launch_env(run_id), umask)
    job_id = stdout.split("\n", 1)[0].strip()
    assert job_id.startswith("j"), f"ddpctl submit printed no job id (exit {rc}): {stderr[-2000:]}"
    with anyio.fail_after(LAUNCH_TIMEOUT):
        job = await d.client.wait(job_id)
        texts: dict[int, str] = {}
        async with d.client.logs(job_id) as chunks:
            async for chunk in chunks:
                texts[chunk.rank] = texts.get(chunk.rank, "") + chunk.text
        async with d.client.events(job_id) as stream:
            events = [e async for e in stream]
    leftovers = [f"the daemon killed leftovers {e.data.get('pids')} ({e.data.get('via') or 'process sweep'})"
                 for e in events if e.kind == "job.leftover_killed"]
    leftovers += await _left_by(run_id)
    assert_nothing_left([job])
    files, modes = snapshot(rundir / "out")
    output = "\n".join(f"--- rank {rank} ---\n{text[-3000:]}" for rank, text in sorted(texts.items()))
    pooled = [bool(e.data.get("pooled")) for e in events if e.kind == "rank.spawned"]
    return Outcome(launcher, rc, result_lines("\n".join(texts.values())), files, modes, leftovers,
                   _ddpd_failure(job), output=output, job=job, pooled=pooled)


async def launch_all(daemons: Daemons, base: Path, script: str, args: list[str] | None = None,
                     umask: int = 0o022) -> dict[str, Outcome]:
    """The script under torchrun, pooled ddpd and cold ddpd at once, each in `base/<launcher>`."""
    outcomes: dict[str, Outcome] = {}

    async def one(launcher: str) -> None:
        rundir = base / launcher
        (rundir / "out").mkdir(parents=True)
        if launcher == "torchrun":
            outcomes[launcher] = await run_torchrun(script, args or [], rundir, umask)
        else:
            d = daemons.pooled if launcher == "pooled" else daemons.cold
            outcomes[launcher] = await run_ddpd(d, launcher, script, args or [], rundir, umask)

    async with anyio.create_task_group() as tg:
        for launcher in LAUNCHERS:
            tg.start_soon(one, launcher)
    return outcomes


def differences(ref: Outcome, got: Outcome, modes: bool = False) -> list[str]:
    """How `got` differs from the reference launch (torchrun), one line per difference."""
    diffs: list[str] = []
    if got.status != ref.status:
        job = got.job
        state = f" (job {job.state}, {job.reason}, {job.root_cause})" if job is not None else ""
        diffs.append(f"exit status {got.status}{state}, torchrun's {ref.status}")
    if got.failure != ref.failure:
        diffs.append(f"root cause {got.failure}, torchrun's {ref.failure}")
    if got.results != ref.results:
        diffs.append(f"RESULT lines {got.results}, torchrun's {ref.results}")
    for path in sorted(set(ref.files) | set(got.files)):
        mine, theirs = got.files.get(path), ref.files.get(path)
        if mine != theirs:
            diffs.append(f"out/{path}: {mine or 'missing'}; torchrun's: {theirs or 'missing'}")
    if modes:
        for path in sorted(set(ref.modes) & set(got.modes)):
            if got.modes[path] != ref.modes[path]:
                diffs.append(f"out/{path}: mode {got.modes[path]}, torchrun's {ref.modes[path]}")
    if got.leftovers:
        diffs.append(f"leftovers: {got.leftovers}")
    if got.launcher == "pooled" and got.pooled != [True] * NPROC:
        diffs.append(f"the ranks were not all pooled: {got.pooled}")
    return diffs


def assert_conform(outcomes: dict[str, Outcome], modes: bool = False) -> None:
    """torchrun's launch left nothing behind, and each ddpd launch ended exactly as it did."""
    ref = outcomes["torchrun"]
    assert not ref.leftovers, f"torchrun's launch left processes: {ref.leftovers}"
    report = []
    for launcher in LAUNCHERS[1:]:
        diffs = differences(ref, outcomes[launcher], modes)
        if diffs:
            report.append(f"{launcher} ddpd differs from torchrun:\n  " + "\n  ".join(diffs))
    if report:
        logs = "\n".join(f"=== {o.launcher} ===\n{o.output}" for o in outcomes.values())
        raise AssertionError("\n".join(report) + f"\n\n{logs}")
