"""One user's history is bounded, by that user's own oldest jobs (issue 34, finding 6).

Bug: a submitter with a large exported environment submitted and cancelled in a loop (~40 jobs/s on
one connection, ~48 KB stored per job), and every ended job was kept for the whole retention (30
days); cancelled jobs did not count against `max_queued_per_user`: several GB an hour until the
state disk was full and every user's submit failed.

Here Ann (a real user, her own client process) floods submit+cancel with a 30 KB environment, and a
job of hers fails (its dependency was cancelled); Bob's three ended jobs were there first; root
submits and cancels eight small jobs. Her final submit is told that her history is at its bound, and
once it returns her ended jobs are her newest only, within `max_history_bytes_per_user`; root keeps
its newest `max_history_per_user`; Bob keeps all of his. The retired jobs leave no row, no event, no
daemon-wide record. Her jobs wait on a root job held at a gate, so none of them ever starts.
"""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from ddpd.daemon.contain.identity import Identity
from ddpd.protocol import JobSpec, JobState

from ..conftest import DaemonProc
from ..scripts.helpers import gated, wait_waiting_at_gate
from ..scripts.userpython import USER_PYTHON
from ..users import plain_env
from .test_shared_box import TIMEOUT, pings, shared_box

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.xdist_group("users"),  # useradd/userdel lock /etc/passwd: one worker at a time
    pytest.mark.skipif(os.geteuid() != 0, reason="a root daemon and real users"),
]

MAX_JOBS = 6
MAX_BYTES = 128 * 1024
PAD = 30_000  # bytes of Ann's exported environment, in every job of hers
FLOOD = 12

# Ann's client: FLOOD submits, each cancelled at once; a job that fails (the job it waited for was
# cancelled); a last submit, whose notices it prints with every id as one JSON line
ANN = r"""
import json, sys
import msgspec
from ddpd.client import Client
from ddpd.protocol import JobSpec
client = Client(sys.argv[1])
spec = msgspec.json.decode(sys.argv[2], type=JobSpec)
ended = []
for _ in range(int(sys.argv[3])):
    job = client.submit(spec)
    client.cancel(job)
    ended.append(job)
first = client.submit(spec)
then = client.submit(msgspec.structs.replace(spec, after=[*spec.after, first]))
client.cancel(first)
failed = client.wait(then)
last = client.submit_result(spec)
print(json.dumps({"ended": [*ended, first, then], "failed": str(failed.state), "last": last.job_id,
                  "notices": list(getattr(last, "notices", []))}), flush=True)
"""


def user_spec(blocker: str, **environ: str) -> JobSpec:
    return JobSpec(task="two-layer", nproc=1, workdir="/tmp", python=USER_PYTHON, environ=plain_env(**environ),
                   after=[blocker])


def stored(state_dir: Path) -> dict[str, tuple[int, str, int | None]]:
    """Every job on record: id -> (owner, state, stored bytes), read as root from the database."""
    db = sqlite3.connect(f"file:{state_dir / 'ddpd.db'}?mode=ro", uri=True)
    db.row_factory = sqlite3.Row
    try:
        rows = [dict(r) for r in db.execute("SELECT * FROM jobs").fetchall()]
    finally:
        db.close()
    return {r["id"]: (r["owner_uid"], r["state"], r.get("stored_bytes")) for r in rows}


def rows_naming(state_dir: Path, job_ids: list[str]) -> list[tuple[object, ...]]:
    """Any row left of these jobs: their own events, ranks, attempts, or a daemon-wide event naming them."""
    db = sqlite3.connect(f"file:{state_dir / 'ddpd.db'}?mode=ro", uri=True)
    try:
        found: list[tuple[object, ...]] = []
        for job_id in job_ids:
            for table in ("events", "ranks", "attempts", "curves"):
                found += db.execute(f"SELECT '{table}', job_id FROM {table} WHERE job_id = ?", (job_id,)).fetchall()
            found += db.execute("SELECT kind, data FROM events WHERE job_id IS NULL AND data LIKE ?",
                                (f"%{job_id}%",)).fetchall()
        return found
    finally:
        db.close()


async def test_a_flood_of_cancelled_jobs_retires_only_the_flooders_oldest(
        users: tuple[Identity, Identity], public_tmp: Path) -> None:
    ann, bob = users
    gate = public_tmp / "gate"
    config = f"max_history_per_user = {MAX_JOBS}\nmax_history_bytes_per_user = {MAX_BYTES}\n"
    async with shared_box(public_tmp, config) as d:
        blocker = await d.client.submit(gated(d, gate, name="holds everyone's jobs"))
        await wait_waiting_at_gate(d, blocker)
        bobs = await _as(bob, d, user_spec(blocker), 2)  # four ended jobs of his, within both bounds
        roots = []
        for _ in range(8):
            roots.append(job := await d.client.submit(d.spec(task="two-layer", after=[blocker])))
            await d.client.cancel(job)
        root_last = await d.client.submit(d.spec(task="two-layer", after=[blocker]))

        seen = await _as(ann, d, user_spec(blocker, PAD="x" * PAD), FLOOD)
        assert seen["failed"] == "FAILED", seen
        record = stored(d.state_dir)
        hers = [j for j in seen["ended"] if j in record]
        assert hers, record
        assert hers == seen["ended"][-len(hers):], (hers, seen["ended"])  # her newest, and only those
        assert len(hers) < len(seen["ended"]), f"all {len(hers)} of Ann's ended jobs are still on record"
        assert all(record[j][0] == ann.uid and record[j][1] in ("CANCELLED", "FAILED") for j in hers), record
        assert seen["ended"][-1] in hers and record[seen["ended"][-1]][1] == "FAILED"  # a failed job counts
        assert sum(record[j][2] or 0 for j in hers) <= MAX_BYTES, [record[j] for j in hers]
        assert rows_naming(d.state_dir, [j for j in seen["ended"] if j not in record]) == []
        assert all(j in record for j in bobs["ended"]), "Bob's jobs went with Ann's flood"
        mine = [j for j in roots if j in record]
        assert mine == roots[-MAX_JOBS:], (mine, roots)  # root is a user too: its count bound
        notices = seen["notices"]
        assert len(notices) == 1 and notices[0].startswith("your history is at its bound:"), notices
        assert f"max_history_bytes_per_user = {MAX_BYTES // 1024} KiB" in notices[0], notices
        await pings(bob, d)
        for job in (root_last, seen["last"], bobs["last"]):
            await d.client.cancel(job)
        gate.touch()
        with anyio.fail_after(TIMEOUT):
            assert (await d.client.wait(blocker)).state == JobState.SUCCEEDED


async def _as(who: Identity, d: DaemonProc, spec: JobSpec, n: int) -> dict[str, Any]:
    """`who`'s client process runs ANN with `spec`, `n` times over; what it printed."""
    with anyio.fail_after(TIMEOUT):
        done = await anyio.run_process([USER_PYTHON, "-c", ANN, str(d.socket), msgspec.json.encode(spec).decode(),
                                        str(n)], user=who.uid, group=who.gid, extra_groups=[], cwd="/",
                                       env=plain_env(), check=False)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    seen: dict[str, Any] = json.loads(done.stdout)
    return seen
