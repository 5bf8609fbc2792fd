"""Job files, `--after`, `resubmit`, id prefixes and job id completion, through ddpctl against a real
daemon with real jobs.

Two cheap jobs run (the built-in task, a step or two); every other job here ends without running,
because the job it waits for was cancelled, which is also the failure case of `--after`.
"""

from __future__ import annotations

import json
import os
import sys
import tomllib
from pathlib import Path
from typing import Any

import anyio
import click
import pytest

from ddpd.cli.commands import submit
from ddpd.protocol import JobState

from ..conftest import REPO, DaemonProc, running_daemon
from ..scripts.helpers import gated
from .test_cli import DDPCTL, TIMEOUT, ddpctl, err, out

pytestmark = pytest.mark.anyio

# every option of `submit` that goes into the spec, as flags and as the same keys of a job file
FLAGS = ["--task", "two-layer", "--nproc", "2", "--oversubscribe", "--name", "every-key", "--backend", "gloo",
         "--device", "cpu", "--gpus-per-rank", "0", "--steps", "3", "--seed", "7", "--join-timeout", "30",
         "--heartbeat-timeout", "20",
         "--progress-timeout", "25", "--wall-time", "600", "--kill-grace", "2", "--stop-warning", "5",
         "--max-restarts", "1", "--hot-replace", "0", "--checkpoint-every", "2", "--priority", "1", "--mem", "512M",
         "--cpus", "1.5",
         "--log-max", "131072", "--nnodes", "1:2", "--rdzv-endpoint", "192.0.2.1:29400", "--rdzv-id", "every-key",
         "--rdzv-backend", "c10d", "--rdzv-keep-alive", "5", "--rdzv-last-call", "1", "--env", "A=1", "--env", "B=two",
         "--workdir", str(REPO), "--python", sys.executable, "--export", "PATH,HOME", "--option", "lr=0.5",
         "--option", "tag=x", "--notify", "true", "--notify-url", "http://127.0.0.1:9/ddpd", "--preemptible"]
FILE = f"""
task = "two-layer"
nproc = 2
oversubscribe = true
name = "every-key"
backend = "gloo"
device = "cpu"
gpus_per_rank = 0
steps = 3
seed = 7
join-timeout = 30
heartbeat_timeout = 20.0
progress-timeout = 25
wall-time = 600
kill-grace = 2
stop-warning = 5
max-restarts = 1
hot-replace = 0
checkpoint_every = 2
priority = 1
mem = "512M"
cpus = 1.5
log-max = 131072
nnodes = "1:2"
rdzv-endpoint = "192.0.2.1:29400"
rdzv_id = "every-key"
rdzv-backend = "c10d"
rdzv-keep-alive = 5
rdzv-last-call = 1
workdir = "{REPO}"
python = "{sys.executable}"
export = "PATH,HOME"
follow = false
notify = "true"
notify-url = "http://127.0.0.1:9/ddpd"
preemptible = true
{{after}}

[env]
A = "1"
B = "two"

[option]
lr = 0.5
tag = "x"
"""
MODULE_FILE = """
module = true
script = "tests.scripts.show_env"
args = ["--steps", "1"]
{after}
"""


def test_the_every_key_job_file_names_every_submit_option() -> None:
    """A submit option added later must be added to FLAGS and FILE above, or this fails."""
    deps = 'after = ["j1"]\nafter-any = "j1"\nafter_notok = ["j1"]'
    keys = {*tomllib.loads(FILE.format(after=deps)), *tomllib.loads(MODULE_FILE.format(after=""))}
    covered = {key.replace("-", "_") for key in keys}
    options = {next(o for o in param.opts if o.startswith("--")).lstrip("-").replace("-", "_")
               for param in submit.params if isinstance(param, click.Option)} - {"file", "idempotency_key", "socket",
                                                                                  "reconnect"}
    assert options - covered == set()
    flags = {arg.lstrip("-").replace("-", "_") for arg in FLAGS if arg.startswith("--")} | {
        "after", "after_any", "after_notok", "module"}
    assert options - flags - {"follow"} == set()


async def status_json(d: DaemonProc, job: str) -> dict[str, Any]:
    done = await ddpctl(d, "status", job, "-o", "json")
    assert done.returncode == 0, err(done)
    return dict(json.loads(out(done)))


async def submitted(d: DaemonProc, *args: str) -> str:
    done = await ddpctl(d, "submit", *args)
    assert done.returncode == 0, err(done)
    return out(done).strip()


async def test_job_files_after_resubmit_prefixes_and_completion(short_tmp: Path) -> None:
    # its multi-node jobs never start; a daemon that cannot fence their ports (not root, no
    # nftables) would refuse them at submit without this
    config = short_tmp / "ddpd.toml"
    config.write_text("allow_unfenced = true\n")
    async with running_daemon(short_tmp, "--cpu-slots", "8", "--config", str(config)) as d:
        a = await submitted(d, "--steps", "2", "--name", "a")
        assert a.startswith("j1-")
        b = await submitted(d, "--steps", "1", "--name", "b", "--after", "j1")  # `j1`: job number 1
        # c waits on a job that trains until cancelled too: still QUEUED when cancelled below however
        # soon a and b are done
        gate = await submitted(d, "--nproc", "1", "--steps", str(10**9), "--name", "gate")
        c = await submitted(d, "--name", "c", "--after", f"{b},{gate}")
        assert (await d.client.status(b)).spec.after == [a]

        # the same job as flags and as a job file (every key), both after c, cancelled below: they
        # fail then, without running, and their stored specs are the same
        job_file = short_tmp / "job.toml"
        job_file.write_text(FILE.format(after=f'after = ["{c.split("-")[0]}"]'))
        by_flags = await submitted(d, *FLAGS, "--after", c, "--idempotency-key", "flags")
        by_file = await submitted(d, "-f", str(job_file), "--idempotency-key", "file")
        module_file = short_tmp / "module.toml"
        module_file.write_text(MODULE_FILE.format(after=f'after = "{c}"'))
        module_flags = await submitted(d, "--after", c, "-m", "tests.scripts.show_env", "--", "--steps", "1")
        module_by_file = await submitted(d, "-f", str(module_file))
        # flags win over the file: a scalar, and a list option (replaced, not merged)
        overridden = await submitted(d, "-f", str(job_file), "--steps", "9", "--env", "A=flag")
        done = await ddpctl(d, "cancel", c[:4])  # a prefix with its dash (j4-x)
        assert done.returncode == 0 and err(done).startswith(f"cancelled {c}"), err(done)
        done = await ddpctl(d, "submit", "--after", c[:4])  # refused now: it could never start
        assert done.returncode == 2 and f"after[0]: job {c} already ended CANCELLED" in err(done), err(done)
        await d.client.cancel(gate)
        with anyio.fail_after(TIMEOUT):
            assert (await d.client.wait(gate)).state == JobState.CANCELLED

        done = await ddpctl(d, "wait", by_file)
        assert done.returncode == 1 and f"FAILED: dependency {c} CANCELLED" in err(done), err(done)
        with anyio.fail_after(TIMEOUT):
            ended = [await d.client.wait(job) for job in (by_flags, module_flags, module_by_file, overridden)]
        assert all(v.reason == f"dependency {c} CANCELLED" and v.attempt == 0 for v in ended)
        flags_view, file_view = await status_json(d, by_flags), await status_json(d, by_file)
        assert flags_view["reason"] == f"dependency {c} CANCELLED" and flags_view["ranks"] == []
        assert flags_view["spec"] == file_view["spec"]
        assert flags_view["spec"]["timeouts"] == {"join": 30.0, "heartbeat": 20.0, "progress": 25.0, "wall": 600.0,
                                                  "kill_grace": 2.0, "stop_warning": 5.0}
        assert flags_view["spec"]["options"] == {"lr": 0.5, "tag": "x"}
        assert ended[1].spec == ended[2].spec and ended[1].spec.module
        spec = ended[3].spec
        assert spec.steps == 9 and spec.env == {"A": "flag"} and spec.name == "every-key"

        # resubmit: a new job with the same spec; not one whose dependency already failed (it could never run)
        done = await ddpctl(d, "resubmit", by_flags.split("-")[0])
        assert done.returncode == 2 and f"job {c} already ended CANCELLED" in err(done), err(done)
        done = await ddpctl(d, "resubmit", "j1")
        assert done.returncode == 0 and f"resubmitted {a} as" in err(done), err(done)
        again = out(done).strip()
        assert again not in (a, "") and (await status_json(d, again))["spec"] == (await status_json(d, a))["spec"]
        await d.client.wait(again)

        # b started only after a succeeded: the events' order, not the clock
        done = await ddpctl(d, "wait", b[:3])
        assert done.returncode == 0, err(done)
        done = await ddpctl(d, "events", "-o", "json")
        events = [json.loads(line) for line in out(done).splitlines()]
        a_done = next(e["seq"] for e in events if e["job_id"] == a and e["kind"] == "job.finished")
        assert next(e for e in events if e["job_id"] == a and e["kind"] == "job.finished")["data"]["state"] == \
            "SUCCEEDED"
        b_starts = [e["seq"] for e in events if e["job_id"] == b and e["kind"] == "job.state_changed"
                    and e["data"]["to"] == "STARTING"]
        assert b_starts and min(b_starts) > a_done

        # prefixes everywhere; an ambiguous one lists the candidates
        for args in (("status", "j1"), ("logs", "j1")):
            done = await ddpctl(d, *args)
            assert done.returncode == 0, (args, err(done))
        done = await ddpctl(d, "status", "j")  # a prefix without its dash names no job
        assert done.returncode == 1 and "no job 'j'" in err(done), err(done)
        done = await ddpctl(d, "submit", "--after", "j99")
        assert done.returncode == 2 and "after[0]: no job 'j99'" in err(done), err(done)

        # job ids complete from the daemon
        env = {**os.environ, "_DDPCTL_COMPLETE": "bash_complete", "COMP_WORDS": f"ddpctl --socket {d.socket} "
               "status j1", "COMP_CWORD": "4"}
        with anyio.fail_after(TIMEOUT):
            done = await anyio.run_process([DDPCTL], env=env, check=False)
        assert done.returncode == 0 and f"plain,{a}" in out(done).splitlines(), out(done)


async def test_a_dependency_survives_a_daemon_restart(short_tmp: Path) -> None:
    gate = short_tmp / "gate"
    state = short_tmp / "state"
    async with running_daemon(short_tmp, state_dir=state) as d:
        blocker = await d.client.submit(gated(d, gate, name="blocker"))
        waiter = await submitted(d, "--steps", "1", "--after", blocker)
        assert (await status_json(d, waiter))["waiting_on"] == [blocker]
    async with running_daemon(short_tmp, state_dir=state) as d:
        # the blocker (started or not) went back to the queue at the shutdown; the waiter still waits
        view = await status_json(d, waiter)
        assert view["state"] == "QUEUED" and view["spec"]["after"] == [blocker]
        done = await ddpctl(d, "cancel", "--force", blocker)
        assert done.returncode == 0, err(done)
        done = await ddpctl(d, "wait", waiter)
        assert done.returncode == 1 and f"dependency {blocker} CANCELLED" in err(done), err(done)
        assert (await status_json(d, waiter))["attempt"] == 0
