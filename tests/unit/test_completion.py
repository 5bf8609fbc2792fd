"""`ddpctl completion`: click's script for each shell, and job id completion that stays silent and
bounded when the daemon is down or does not answer."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from ddpd.cli import completion as completion_module
from ddpd.cli.commands import cli
from ddpd.cli.completion import JOB_ID, job_completions


@pytest.mark.parametrize(("shell", "marker"), [
    ("bash", "complete -o nosort -F _ddpctl_completion ddpctl"),
    ("zsh", "#compdef ddpctl"),
    ("fish", "complete --no-files --command ddpctl"),
])
def test_the_script_of_each_shell_is_printed(shell: str, marker: str) -> None:
    result = CliRunner().invoke(cli, ["completion", shell])
    assert result.exit_code == 0, result.output
    assert marker in result.output and "_DDPCTL_COMPLETE" in result.output


def test_an_unknown_shell_is_a_usage_error() -> None:
    result = CliRunner().invoke(cli, ["completion", "tcsh"])
    assert result.exit_code == 2 and "tcsh" in result.output


def test_every_job_argument_completes_job_ids() -> None:
    for name in ("status", "wait", "cancel", "rm", "logs", "events", "stacks", "watch", "resubmit"):
        params = {p.name: p for p in cli.commands[name].params}
        assert params["job_ids" if name == "cancel" else "job_id"].type is JOB_ID, name
    assert {p.name: p for p in cli.commands["submit"].params}["after"].type is JOB_ID


def test_no_daemon_completes_nothing_silently(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert job_completions(tmp_path / "absent.sock", "j") == []
    assert capsys.readouterr() == ("", "")


def test_a_daemon_that_does_not_answer_is_waited_for_a_bounded_time(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(completion_module, "COMPLETION_TIMEOUT", 0.1)
    path = tmp_path / "mute.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as mute:  # accepts (backlog), never answers
        mute.bind(str(path))
        mute.listen(4)
        start = time.monotonic()
        assert job_completions(path, "j") == []
        assert time.monotonic() - start < 5
