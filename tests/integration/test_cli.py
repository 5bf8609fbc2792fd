"""ddpctl against a real daemon: every command as a user runs it (a subprocess, its stdout,
stderr and exit code)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
from anyio.abc import Process

from ddpd.protocol.paths import SYSTEM_SOCKET

from ..conftest import REPO, DaemonProc, assert_nothing_left, running_daemon
from ..scripts.helpers import gated, wait_state

pytestmark = pytest.mark.anyio

DDPCTL = str(Path(sys.executable).parent / "ddpctl")
TIMEOUT = 120


async def ddpctl(d: DaemonProc | Path, *args: str, cwd: Path = REPO,
                 timeout: float = TIMEOUT) -> subprocess.CompletedProcess[bytes]:
    sock = d if isinstance(d, Path) else d.socket
    with anyio.fail_after(timeout):
        return await anyio.run_process([DDPCTL, "--socket", str(sock), *args], check=False,
                                       stdin=subprocess.DEVNULL, cwd=str(cwd))


def out(done: subprocess.CompletedProcess[bytes]) -> str:
    return done.stdout.decode()


def err(done: subprocess.CompletedProcess[bytes]) -> str:
    return done.stderr.decode()


async def _spawn(d: DaemonProc, *args: str) -> Process:
    return await anyio.open_process([DDPCTL, "--socket", str(d.socket), *args], stdin=subprocess.DEVNULL,
                                    cwd=str(REPO))


async def _read_until(proc: Process, needle: str, count: int = 1) -> str:
    """Read a running ddpctl's stdout until `needle` appeared `count` times (a handshake)."""
    assert proc.stdout is not None
    text = ""
    with anyio.fail_after(TIMEOUT):
        async for data in proc.stdout:
            text += data.decode()
            if text.count(needle) >= count:
                return text
    raise AssertionError(f"output ended without {needle!r}: {text}")


async def _finish(proc: Process) -> tuple[int, str, str]:
    """Wait for a ddpctl started with `_spawn` to end on its own; its rc, the rest of stdout, stderr."""
    assert proc.stdout is not None and proc.stderr is not None
    rest, errors = b"", b""
    with anyio.fail_after(TIMEOUT):
        async for data in proc.stdout:
            rest += data
        async for data in proc.stderr:
            errors += data
        rc = await proc.wait()
    return rc, rest.decode(), errors.decode()


async def test_submit_wait_status_ls_logs_events(daemon: DaemonProc) -> None:
    # no --workdir: ddpctl sends its current directory, where the task module is importable
    done = await ddpctl(daemon, "submit", "--task", "tests.scripts.gated:make_task", "--nproc", "2",
                        "--steps", "2", "--name", "cli")
    assert done.returncode == 0, err(done)
    job_id = out(done).strip()
    assert job_id.startswith("j") and "\n" not in job_id

    done = await ddpctl(daemon, "wait", job_id)
    assert done.returncode == 0 and "SUCCEEDED" in err(done)

    done = await ddpctl(daemon, "status", job_id, "-o", "json")
    view = json.loads(out(done))
    assert view["state"] == "SUCCEEDED" and view["spec"]["workdir"] == str(REPO)
    assert [r["step"] for r in view["ranks"]] == [2, 2]
    done = await ddpctl(daemon, "status", job_id)
    assert done.returncode == 0 and "SUCCEEDED" in out(done) and "root" in out(done)
    assert all(line == line.rstrip() for line in out(done).splitlines())  # bug: padded to 200 columns

    done = await ddpctl(daemon, "ls", "-o", "json")
    [listed] = json.loads(out(done))
    assert listed["id"] == job_id and listed["owner_uid"] == 0
    done = await ddpctl(daemon, "ls")
    assert job_id in out(done) and "root" in out(done) and "owner" in out(done)
    assert "succeeded" not in out(done).lower().replace("SUCCEEDED".lower(), "", 1)  # no "all ranks succeeded"
    done = await ddpctl(daemon, "ls", "--active")
    assert done.returncode == 0 and out(done) == "" and "no active jobs" in err(done)  # not an empty table

    done = await ddpctl(daemon, "logs", job_id, "--rank", "1")
    assert done.returncode == 0
    lines = [json.loads(line.split(" ", 1)[1]) for line in out(done).splitlines() if line.startswith("ddpd-test-env")]
    assert [line["rank"] for line in lines] == [1] and "[rank" not in out(done)
    done = await ddpctl(daemon, "logs", job_id)
    assert "[rank 0] ddpd-test-env" in out(done) and "[rank 1] ddpd-test-env" in out(done)
    done = await ddpctl(daemon, "logs", job_id, "-o", "json")
    chunks = [json.loads(line) for line in out(done).splitlines()]
    assert {c["rank"] for c in chunks} == {0, 1} and all(c["attempt"] == 1 for c in chunks)

    done = await ddpctl(daemon, "events", job_id, "-o", "json")
    events = [json.loads(line) for line in out(done).splitlines()]
    kinds = [e["kind"] for e in events]
    assert kinds[0] == "job.submitted" and kinds[-1] == "job.finished"
    assert all(e["job_id"] == job_id for e in events)
    done = await ddpctl(daemon, "events", job_id)
    assert "job.finished" in out(done) and f"job={job_id}" in out(done)
    done = await ddpctl(daemon, "events", job_id, "-f", "--tail", "2", "-o", "json")  # not the whole history
    assert [json.loads(line)["seq"] for line in out(done).splitlines()] == [e["seq"] for e in events[-2:]]

    done = await ddpctl(daemon, "logs", job_id, "--rank", "7")
    assert done.returncode == 1 and "no rank 7" in err(done)
    done = await ddpctl(daemon, "status", "nosuchjob")
    assert done.returncode == 1 and "not_found" in err(done)
    assert_nothing_left([await daemon.client.status(job_id)])


async def test_submit_follow_exit_codes_and_bad_specs(daemon: DaemonProc) -> None:
    # a relative script path, resolved in the submitter's directory
    done = await ddpctl(daemon, "submit", "--follow", "--", "tests/scripts/show_env.py", "--steps", "2")
    assert done.returncode == 0, err(done)
    job_id, *log = out(done).splitlines()
    assert "[rank 0] rank 0 of 1 ok" in log and "SUCCEEDED" in err(done)

    done = await ddpctl(daemon, "submit", "--follow", "-m", "tests.scripts.show_env", "--", "--steps", "1")
    assert done.returncode == 0, err(done)
    module_id = out(done).splitlines()[0]
    assert "[rank 0] rank 0 of 1 ok" in out(done)
    assert (await daemon.client.status(module_id)).spec.script == ["tests.scripts.show_env", "--steps", "1"]

    done = await ddpctl(daemon, "submit", "--follow", "--", "tests/scripts/show_env.py", "--exit-code", "3")
    assert done.returncode == 1
    failed_id = out(done).splitlines()[0]
    assert "FAILED" in err(done) and "exit 3" in err(done)

    done = await ddpctl(daemon, "submit", "--nproc", "0")
    assert done.returncode == 2 and "nproc" in err(done) and "bad_spec" in err(done)
    done = await ddpctl(daemon, "submit", "--nproc", "999")  # more ranks than CPU slots: never fits
    assert done.returncode == 2 and "nproc: can never run here" in err(done)
    assert "cpu_slots" in err(done) and "--oversubscribe" in err(done)  # bug: the setting was not named
    slots = (await daemon.client.daemon_info()).cpu_slots
    done = await ddpctl(daemon, "submit", "--nproc", str(slots + 1), "--oversubscribe", "--steps", "2", "--follow")
    assert done.returncode == 0 and f"{slots + 1} ranks on the daemon's {slots} CPU slots" in err(done), err(done)
    over_id = out(done).splitlines()[0]
    done = await ddpctl(daemon, "submit", "--task", "no such task")
    assert done.returncode == 2 and "task" in err(done)
    done = await ddpctl(daemon, "submit", "--", "tests/scripts/missing.py")
    assert done.returncode == 2 and "script" in err(done)
    done = await ddpctl(daemon, "submit", "--env", "NOEQUALS")
    assert done.returncode == 2 and "KEY=VALUE" in err(done)
    jobs = await daemon.client.list_jobs()
    assert {j.id for j in jobs} == {job_id, module_id, failed_id, over_id}
    assert_nothing_left(jobs)


async def test_cancel_logs_follow_watch_and_a_queued_follow(short_tmp: Path) -> None:
    gate = short_tmp / "gate"
    async with running_daemon(short_tmp, "--cpu-slots", "2") as d:
        done = await ddpctl(d, "submit", "--task", "tests.scripts.gated:make_task", "--nproc", "2",
                            "--option", f"gate={gate}")
        blocker = out(done).strip()
        follow_logs = await _spawn(d, "logs", "-f", blocker)
        await _read_until(follow_logs, "waiting for gate", count=2)
        # the blocker holds both slots: this job waits, and --follow shows its logs once it runs
        queued_follow = await _spawn(d, "submit", "--follow", "--", "tests/scripts/show_env.py")
        watch_json = await _spawn(d, "watch", blocker, "-o", "json")
        await _read_until(watch_json, '"state":"RUNNING"')
        watch = await _spawn(d, "watch", blocker)
        done = await ddpctl(d, "ls", "-o", "json")
        states = {j["id"]: j["state"] for j in json.loads(out(done))}
        assert states[blocker] == "RUNNING" and sorted(states.values()) == ["QUEUED", "RUNNING"]

        done = await ddpctl(d, "cancel", blocker)
        assert done.returncode == 0, err(done)
        assert err(done).startswith(f"stopping {blocker}: ranks asked to stop")
        rc, rest, _ = await _finish(follow_logs)
        assert rc == 0
        rc, rest, errors = await _finish(watch)
        assert rc == 1 and "CANCELLED" in errors  # watch ends on its own with the job's result
        assert "TRAINING" in rest or "EXITED" in rest  # its last frame: the ranks table
        rc, rest, errors = await _finish(watch_json)
        assert rc == 1 and json.loads(rest.splitlines()[-1])["state"] == "CANCELLED"
        rc, rest, errors = await _finish(queued_follow)
        assert rc == 0, errors
        assert "[rank 0] rank 0 of 1 ok" in rest

        done = await ddpctl(d, "wait", blocker)
        assert done.returncode == 1 and "CANCELLED" in err(done)
        done = await ddpctl(d, "cancel", blocker)
        assert done.returncode == 1 and "already ended" in err(done)
        done = await ddpctl(d, "watch", blocker, "-o", "json")
        assert done.returncode == 1 and json.loads(out(done).splitlines()[-1])["state"] == "CANCELLED"
        await wait_state(d, blocker, "CANCELLED")


async def test_ping_daemon_reload_and_an_unreachable_daemon(daemon: DaemonProc, short_tmp: Path) -> None:
    done = await ddpctl(daemon, "ping")
    assert done.returncode == 0 and out(done).startswith("pong from")
    done = await ddpctl(daemon, "daemon", "-o", "json")
    info = json.loads(out(done))
    assert info["socket"] == str(daemon.socket) and info["cpu_slots"] >= 1 and info["running"] == 0
    done = await ddpctl(daemon, "daemon")
    assert "cpu slots" in out(done) and str(info["pid"]) in out(done)
    done = await ddpctl(daemon, "reload")
    assert done.returncode == 0 and "reloaded" in err(done)
    done = await ddpctl(short_tmp / "nobody-here.sock", "ping")
    assert done.returncode == 3 and "no such socket" in err(done)
    if not SYSTEM_SOCKET.exists():  # bug: root was told of /tmp/ddpd-0 only, its daemon listens in /run/ddpd
        runtime = short_tmp / "runtime"
        runtime.mkdir(mode=0o700)
        env = {k: v for k, v in os.environ.items() if k != "DDPD_SOCKET"} | {"XDG_RUNTIME_DIR": str(runtime)}
        with anyio.fail_after(TIMEOUT):
            done = await anyio.run_process([DDPCTL, "ping"], check=False, env=env)
        assert done.returncode == 3, err(done)
        assert f"tried {runtime}/ddpd/ddpd.sock (no such socket), {SYSTEM_SOCKET} (no such socket)" in err(done)


async def test_example_task_runs_from_its_directory(daemon: DaemonProc) -> None:
    """The README's example: `cd examples && ddpctl submit --task mytask:make_task ... --follow`."""
    done = await ddpctl(daemon, "submit", "--task", "mytask:make_task", "--nproc", "2", "--steps", "30",
                        "--option", "lr=0.05", "--follow", cwd=REPO / "examples")
    assert done.returncode == 0, err(done)
    job_id = out(done).splitlines()[0]
    view = await daemon.client.status(job_id)
    assert [r.step for r in view.ranks] == [30, 30]
    assert all(r.loss is not None and r.loss < 1.0 for r in view.ranks)
    assert view.ranks[0].checksum == view.ranks[1].checksum
    assert_nothing_left([view])


async def test_short_ids_name_one_job_and_cancel_takes_several(short_tmp: Path) -> None:
    """Bug: after `rm j1`, `status j1` showed j10 and a second `rm j1` removed j10, printing "removed j1".
    `j<N>` names job N or nothing; rm, cancel and resubmit print the full id they acted on."""
    async with running_daemon(short_tmp, "--cpu-slots", "1") as d:
        blocker = await d.client.submit(gated(d, short_tmp / "gate", name="blocker"))
        queued = [await d.client.submit(d.spec(task="two-layer", steps=1, name=f"q{i}")) for i in range(2, 12)]
        assert blocker.startswith("j1-") and queued[8].startswith("j10-")
        done = await ddpctl(d, "ls", "-o", "json")  # each queued job says what it waits for
        pending = {j["id"]: j["pending"] for j in json.loads(out(done))}
        assert pending[queued[0]] == "resources: needs 1 CPU slots, 0 of 1 free", pending
        assert pending[queued[5]] == f"priority: behind {queued[0]}, which waits for resources"
        done = await ddpctl(d, "status", queued[0])
        assert re.search(r"^pending +resources: needs 1 CPU slots", out(done), re.M), out(done)
        done = await ddpctl(d, "cancel", "--name", "q2", "--name", "q3", "--state", "queued")
        assert done.returncode == 0
        assert sorted(err(done).splitlines()) == [f"cancelled {j} (was QUEUED)" for j in queued[:2]], err(done)
        done = await ddpctl(d, "cancel", queued[2], "j5", "j99")  # one unknown: the others are cancelled
        assert done.returncode == 1 and f"cancelled {queued[3]}" in err(done) and "no job 'j99'" in err(done)
        done = await ddpctl(d, "cancel", "--mine", "--state", "QUEUED")
        assert done.returncode == 0 and len(err(done).splitlines()) == 6, err(done)
        notok = await d.client.submit(d.spec(task="two-layer", steps=1, after_notok=["j1"]))
        anyway = await d.client.submit(d.spec(task="two-layer", steps=1, after_any=["j1"]))
        assert (await d.client.status(notok)).pending == f"dependency: waiting for {blocker}"
        done = await ddpctl(d, "cancel", "--force", "j1")
        assert done.returncode == 0 and err(done).startswith(f"killing {blocker}"), err(done)
        await d.client.wait(blocker)
        with anyio.fail_after(TIMEOUT):  # the blocker was cancelled: both kinds start
            assert [(await d.client.wait(j)).state for j in (notok, anyway)] == ["SUCCEEDED", "SUCCEEDED"]
        done = await ddpctl(d, "submit", "--after-notok", anyway)
        assert done.returncode == 2 and f"after_notok[0]: job {anyway} already ended SUCCEEDED" in err(done)
        done = await ddpctl(d, "status", queued[0])
        assert "cancelled by root (uid 0)" in out(done) and "without running" in out(done), out(done)
        done = await ddpctl(d, "rm", "j1")
        assert done.returncode == 0 and err(done).strip() == f"removed {blocker}", err(done)
        for args in (("status", "j1"), ("rm", "j1")):
            done = await ddpctl(d, *args)
            assert done.returncode == 1 and "no job 'j1'" in err(done), (args, err(done))
        done = await ddpctl(d, "resubmit", "j10")
        assert done.returncode == 0 and f"resubmitted {queued[8]} as {out(done).strip()}" in err(done)
        await ddpctl(d, "cancel", "--force", out(done).strip())
        with anyio.fail_after(TIMEOUT):
            views = [await d.client.wait(v.id) for v in await d.client.list_jobs()]
        assert queued[8] in {v.id for v in views} and blocker not in {v.id for v in views}


async def test_wait_logs_and_watch_ride_out_a_daemon_restart(short_tmp: Path) -> None:
    """Bug: `wait`, `logs -f` and `watch` exited 3 when the daemon restarted, though the requeued job
    then succeeded. They reconnect, saying so on stderr; only a daemon that stays away ends them (3)."""
    gate, state = short_tmp / "gate", short_tmp / "state"
    async with running_daemon(short_tmp, state_dir=state) as d:
        job_id = await d.client.submit(gated(d, gate))
        follow_logs = await _spawn(d, "logs", "-f", job_id, "--reconnect", "120", "-o", "json")
        logged = await _read_until(follow_logs, "waiting for gate")
        watch = await _spawn(d, "watch", job_id, "-o", "json")
        await _read_until(watch, '"state":"RUNNING"')
        waiting = await _spawn(d, "wait", job_id)
    # the daemon is away: one who gives up soon says why, with exit 3
    done = await ddpctl(short_tmp / "ddpd.sock", "wait", job_id, "--reconnect", "0.3")
    assert done.returncode == 3 and "reconnecting for up to 0.3s" in err(done), err(done)
    assert "still away after 0.3s" in err(done), err(done)
    gate.touch()
    async with running_daemon(short_tmp, state_dir=state) as d:
        for proc in (waiting, follow_logs, watch):
            rc, rest, errors = await _finish(proc)
            assert rc == 0 and "reconnecting" in errors and "reconnected to ddpd" in errors, errors
            assert "()" not in errors and ": )" not in errors  # bug: watch's reason was empty
            logged += rest if proc is follow_logs else ""
        assert json.loads(rest.splitlines()[-1])["state"] == "SUCCEEDED"
        chunks = [json.loads(line) for line in logged.splitlines()]  # on where it stood, nothing twice
        assert sum(c["attempt"] == 1 and "waiting for gate" in c["text"] for c in chunks) == 1, chunks
        assert any(c["attempt"] == 2 for c in chunks), chunks
        view = await d.client.status(job_id)
        assert view.state == "SUCCEEDED" and view.attempt == 2
