"""Job files read as hostile input, and their keys checked against `submit`'s options (no daemon)."""

from __future__ import annotations

import os
from pathlib import Path

import click
import pytest

from ddpd.cli.commands import submit
from ddpd.cli.jobfile import MAX_JOB_FILE, BadJobFile, job_defaults, load_job_file


def defaults(tmp_path: Path, text: str) -> tuple[dict[str, object], list[str]]:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return job_defaults(submit, path, load_job_file(path))


def error_of(tmp_path: Path, text: str) -> str:
    with pytest.raises(BadJobFile) as info:
        defaults(tmp_path, text)
    return info.value.format_message()


def test_keys_become_the_defaults_of_submits_options(tmp_path: Path) -> None:
    found, script = defaults(tmp_path, """
        nproc = 2
        gpus-per-rank = 0
        join_timeout = 5
        module = true
        after = "j3"
        script = ["pkg.mod", "--lr"]
        args = ["0.1"]
        [env]
        A = "1"
        [option]
        lr = 0.5
        flag = true
    """)
    assert found == {"nproc": 2, "gpus_per_rank": 0, "join_timeout": 5.0, "module": True, "after": ["j3"],
                     "env": ["A=1"], "options": ["lr=0.5", "flag=true"]}
    assert script == ["pkg.mod", "--lr", "0.1"]


@pytest.mark.parametrize(("text", "message"), [
    ("nprocs = 2", "unknown key 'nprocs'; did you mean 'nproc'?"),
    ("zzz = 1", "unknown key 'zzz'; known keys:"),
    ('nproc = "two"', "'nproc' must be an integer, got a string ('two')"),
    ("nproc = 2.5", "'nproc' must be an integer, got a number (2.5)"),
    ("steps = true", "'steps' must be an integer, got a boolean"),
    ('wall-time = "1h"', "'wall-time' must be a number, got a string"),
    ('backend = "mpi"', "'backend' must be one of auto, gloo, nccl, got 'mpi'"),
    ('module = "yes"', "'module' must be true or false"),
    ("env = 3", "'env' must be a string, a list of strings or a table"),
    ("script = 3", "'script' must be a string or a list of strings"),
    ('args = ["x"]', "'args' needs a 'script'"),
    ("[option]\nx = [1]", "'option.x' must be a string, a number or true/false"),
    ("nproc = ", "is not valid TOML"),
    ("file = 'x.toml'", "unknown key 'file'"),
])
def test_a_bad_key_or_value_is_named(tmp_path: Path, text: str, message: str) -> None:
    assert message in error_of(tmp_path, text)


def test_files_that_are_not_plain_bounded_files_are_refused(tmp_path: Path) -> None:
    def refused(path: Path) -> str:
        with pytest.raises(BadJobFile) as info:
            load_job_file(path)
        return info.value.format_message()

    assert "no such file" in refused(tmp_path / "missing.toml")
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    assert "is a FIFO" in refused(fifo)  # and no hang: opened without blocking
    real = tmp_path / "real.toml"
    real.write_text("nproc = 1\n")
    link = tmp_path / "link.toml"
    link.symlink_to(real)
    assert "is a symlink" in refused(link)
    assert "is a directory" in refused(tmp_path)
    huge = tmp_path / "huge.toml"
    huge.write_text("#" * (MAX_JOB_FILE + 1))
    assert f"a job file is at most {MAX_JOB_FILE}" in refused(huge)
    binary = tmp_path / "bin.toml"
    binary.write_bytes(b"name = '\xff'\n")
    assert "not UTF-8" in refused(binary)


def test_flags_win_over_the_file_through_click(tmp_path: Path) -> None:
    """The file only fills defaults: what the command line gives is what click parses."""
    path = tmp_path / "job.toml"
    path.write_text('nproc = 3\nsteps = 4\nenv = ["A=file"]\nscript = "train.py"\n')
    ctx = submit.make_context("submit", ["-f", str(path), "--steps", "9", "--env", "A=flag"])
    assert ctx.params["nproc"] == 3 and ctx.params["steps"] == 9 and ctx.params["env"] == ("A=flag",)
    assert ctx.meta["ddpd.job_file_script"] == ("train.py",)
    with pytest.raises(click.BadParameter):
        submit.make_context("submit", ["-f", str(tmp_path / "missing.toml")])
