"""`ddpctl logs` queries through the real CLI against a real daemon and one real script job of two
ranks that writes known lines to stdout and stderr in phases the test releases: `--since` a time
taken between two phases shows the second only, `--tail`, `--stream`, rank sets, `--timestamps`;
then a phase past the job's 64 KiB rotation limit keeps the newest lines of both streams, and the
job's logs go with it when retention prunes it."""

from __future__ import annotations

import os
import re
import time
from datetime import datetime
from pathlib import Path

import anyio
import pytest

from ddpd.client import EventView, format_stamp
from ddpd.daemon.layout import stderr_log
from ddpd.daemon.ranklogs.logindex import decode, index_path
from ddpd.protocol import JobState

from ..conftest import DaemonProc, assert_nothing_left, running_daemon
from .test_cli import _finish, _read_until, _spawn, ddpctl, err, out

pytestmark = pytest.mark.anyio

STAMP = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z) (.*)$")
A = {f"A-{s} {r} {i}" for s in ("out", "err") for r in (0, 1) for i in range(3)}
B = {f"B-{s} {r} {i}" for s in ("out", "err") for r in (0, 1) for i in range(3)}


async def logs(d: DaemonProc, job_id: str, *args: str) -> list[str]:
    done = await ddpctl(d, "logs", job_id, *args)
    assert done.returncode == 0, err(done)
    return out(done).splitlines()


def unprefixed(lines: list[str]) -> list[str]:
    return [line.split("] ", 1)[1] if line.startswith("[rank ") else line for line in lines]


async def indexed(paths: list[str], phase: str) -> None:
    """Until each log ends with the last line of `phase` and the daemon has noted all of it in its
    index (so each line of it has its stamp); a handshake on the files, bounded."""
    with anyio.fail_after(60):
        for path in paths:
            stream = "err" if path.endswith(".err") else "out"
            last = f"{phase}-{stream} {path.rsplit('rank-', 1)[1][0]} 2\n".encode()
            while True:
                data = await anyio.Path(path).read_bytes()
                idx = decode(await anyio.Path(index_path(path)).read_bytes())
                if data.endswith(last) and idx and idx.offsets[-1] >= len(data):
                    break
                await anyio.sleep(0.05)


async def test_tail_since_streams_rank_sets_rotation_and_retention(short_tmp: Path) -> None:
    config = short_tmp / "ddpd.toml"
    config.write_text("retention = 0\n")
    gate1, gate2 = short_tmp / "gate1", short_tmp / "gate2"
    async with running_daemon(short_tmp, "--config", str(config)) as d:
        done = await ddpctl(d, "submit", "--nproc", "2", "--log-max", str(64 * 1024), "--",
                            "tests/scripts/log_phases.py", str(gate1), str(gate2))
        assert done.returncode == 0, err(done)
        job_id = out(done).strip()
        await d.wait_event(job_id, lambda e: e.kind == "rank.spawned" and e.data.get("rank", e.rank) == 1)
        view = await d.client.status(job_id)
        paths = [p for r in view.ranks for p in (r.log or "", stderr_log(r.log or ""))]
        await indexed(paths, "A")  # phase A written whole, and stamped
        cut = time.time()
        gate1.touch()
        await indexed(paths, "B")

        # both streams of both ranks, in the order the daemon received them: phase A, then phase B
        merged = unprefixed(await logs(d, job_id))
        assert set(merged) == A | B and all(line in A for line in merged[:12]), merged
        assert set(await logs(d, job_id, "--since", "10m")) >= {f"[rank 0] {line}" for line in ("A-out 0 0",
                                                                                              "B-err 0 2")}
        since = unprefixed(await logs(d, job_id, "--since", datetime.fromtimestamp(cut).isoformat()))
        assert set(since) == B and len(since) == len(B), since
        # kept apart on disk, and apart in a query
        assert set(unprefixed(await logs(d, job_id, "--stream", "stderr"))) == {x for x in A | B if "-err" in x}
        on_disk = "A-out 0 0\nA-out 0 1\nA-out 0 2\nB-out 0 0\nB-out 0 1\nB-out 0 2\n"
        assert await anyio.Path(paths[0]).read_text() == on_disk
        assert await logs(d, job_id, "--rank", "1", "--stream", "stdout", "--tail", "2") == ["B-out 1 1", "B-out 1 2"]
        assert await logs(d, job_id, "--rank", "0", "--stream", "stderr", "--tail", "4") == [
            "A-err 0 2", "B-err 0 0", "B-err 0 1", "B-err 0 2"]
        tail = await logs(d, job_id, "--rank", "0-1", "--tail", "2")  # the last 2 of each rank, both streams
        assert len(tail) == 4 and {"[rank 0] B-err 0 2", "[rank 1] B-err 1 2"} <= set(tail), tail
        assert set(unprefixed(tail)) <= B
        assert await logs(d, job_id, "--rank", "1", "--since", "0s") == []
        stamped = await logs(d, job_id, "--rank", "0", "--timestamps")
        parsed = [STAMP.match(line) for line in stamped]
        assert all(parsed) and len(parsed) == 12, stamped
        for match in parsed:
            assert match is not None
            when = datetime.fromisoformat(match.group(1).replace("Z", "+00:00")).timestamp()
            assert (when <= cut) == match.group(2).startswith("A-"), (cut, format_stamp(cut), stamped)
        follower = await _spawn(d, "logs", job_id, "-f", "--tail", "1", "--rank", "1", "--stream", "stderr")
        try:  # following starts at the tail
            assert await _read_until(follower, "B-err 1 2") == "B-err 1 2\n"
        finally:
            follower.kill()
            await follower.wait()
        bad = await ddpctl(d, "logs", job_id, "--rank", "0,5")
        assert bad.returncode == 1 and "no rank 5" in err(bad)
        bad = await ddpctl(d, "logs", job_id, "--rank", "2-1")
        assert bad.returncode == 2 and "--rank" in err(bad) and "runs backwards" in err(bad)
        bad = await ddpctl(d, "logs", job_id, "--since", "yesterday")
        assert bad.returncode == 2 and "--since" in err(bad)

        follower = await _spawn(d, "logs", job_id, "-f", "--rank", "0", "--stream", "stdout")
        seen = await _read_until(follower, "B-out 0 2")
        gate2.touch()  # phase C: past the 64 KiB limit on both streams
        with anyio.fail_after(120):
            job = await d.client.wait(job_id)
        assert job.state == JobState.SUCCEEDED, job.root_cause
        rc, rest, _ = await _finish(follower)  # it followed through the rotation to the job's end
        followed = (seen + rest).splitlines()
        assert rc == 0 and followed[:6] == [f"{p}-out 0 {i}" for p in "AB" for i in range(3)], followed[:8]
        assert followed[-1] == "END-out 0", followed[-3:]
        c_lines = [int(line[8:]) for line in followed[6:-1] if re.fullmatch(r"C-out 0 \d{5}", line)]
        assert c_lines == sorted(set(c_lines)) and c_lines[-1] == 5999 and len(followed) - 7 - len(c_lines) <= 2
        for rank in (0, 1):
            for stream in ("out", "err"):
                lines = await logs(d, job_id, "--rank", str(rank), "--stream", f"std{stream}")
                assert lines[-1] == f"END-{stream} {rank}" and not set(lines) & (A | B), lines[:3]
                whole = re.compile(f"^C-{stream} {rank} (\\d{{5}})$")
                numbers = [int(m.group(1)) for line in lines[:-1] if (m := whole.match(line))]
                assert numbers == sorted(set(numbers)) and numbers[-1] == 5999 and len(numbers) > 1000
                assert len(lines) - 1 - len(numbers) <= 2, [x for x in lines if not whole.match(x)]
        rotated = {(e.data.get("rank", e.rank), e.data["stream"]) for e in await _events(d, job_id)
                   if e.kind == "rank.log_rotated"}
        assert rotated == {(r, s) for r in (0, 1) for s in ("stdout", "stderr")}
        assert all(os.stat(p).st_size + os.stat(f"{p}.1").st_size <= 96 * 1024 for p in paths)

        config.write_text("retention = 1\n")  # the job ended over a second ago by now or soon: pruned
        assert (await ddpctl(d, "reload")).returncode == 0
        await d.wait_event(None, lambda e: e.kind == "job.pruned" and e.data.get("pruned") == job_id)
        job_dir = Path(paths[0]).parent.parent
        assert not job_dir.exists(), sorted(job_dir.rglob("*"))
    assert_nothing_left([job])


async def _events(d: DaemonProc, job_id: str) -> list[EventView]:
    return [e async for e in d.client.events(job_id)]
