"""The commands the README and docs show: every `ddpctl` and `ddpd` line of their code blocks names a
command that exists and only options that command takes (as its --help lists them), and the README's
"by hand" block puts both programs on the PATH as it says.

A doc that drifts from the program (a renamed flag, a command that went) fails here, not in front of
a new user. Commands are read from fenced blocks only (sh, console, bash, shell); `$ ` prompts and
`# comments` are dropped, `...`, `<placeholders>` and anything after `--` (a script's own arguments)
are not options.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import click
import pytest

from ddpd.cli import cli as ddpctl_group
from ddpd.daemon.main import main as ddpd_group

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
_FENCE = re.compile(r"^```(\w*)\s*$")
_SHELL = {"sh", "bash", "console", "shell"}
PROGRAMS = {"ddpctl": ddpctl_group, "ddpd": ddpd_group}


def shell_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of every line of the file's shell code blocks, prompts and comments dropped."""
    lines: list[tuple[int, str]] = []
    block: str | None = None
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        fence = _FENCE.match(line.strip())
        if fence:
            block = None if block is not None else fence.group(1)
            continue
        if block in _SHELL:
            text = re.sub(r"^\s*\$ ", "", line)
            text = re.sub(r"\s#(?!\S*\]).*$", "", text)  # a comment (`#` after a blank, not a tag like [#3])
            lines.append((number, text))
    return lines


def invocations(text: str) -> list[list[str]]:
    """The argv of each ddpctl or ddpd command in a shell line (several with `&&`, `|`, `;`, `$(...)`)."""
    try:
        words = shlex.split(text.replace("$(", " ").replace(")", " "), comments=False)
    except ValueError:
        return []
    found: list[list[str]] = []
    for i, word in enumerate(words):
        name = word.rsplit("/", 1)[-1]
        if name in PROGRAMS and (i == 0 or words[i - 1] in {"&&", "||", "|", ";", "then", "do", "!", "sudo"}
                                 or words[i - 1].endswith(("=", ";"))):
            argv = [name]
            for rest in words[i + 1:]:
                if rest in {"&&", "||", "|", ";", "&", ">", "2>", "<"} or rest.startswith((">", "2>")):
                    break
                argv.append(rest)
            found.append(argv)
    return found


def _options(command: click.Command) -> set[str]:
    opts = {"--help", "-h"}
    for param in command.params:
        if isinstance(param, click.Option):
            opts.update(param.opts)
            opts.update(param.secondary_opts)
    return opts


def problems(argv: list[str]) -> list[str]:
    """What in one invocation disagrees with the program: an unknown command or option."""
    group = PROGRAMS[argv[0]]
    assert isinstance(group, click.Group)
    args = argv[1:]
    group_opts = _options(group) | {"--version"}
    while args and args[0].startswith("-"):  # the group's own options (--socket PATH)
        flag = args.pop(0).split("=", 1)[0]
        if flag not in group_opts:
            return [f"{argv[0]} has no option {flag}"]
        if flag == "--socket" and args:
            args.pop(0)
    if not args or not re.fullmatch(r"[a-z][a-z-]*", args[0]):
        return []  # `ddpctl` alone, or a placeholder such as COMMAND
    command = group.commands.get(args[0])
    if command is None:
        return [f"{argv[0]} has no command {args[0]!r}"]
    known = _options(command)
    found = []
    for word in args[1:]:
        if word == "--":
            break
        if re.fullmatch(r"--?[A-Za-z][\w-]*(=.*)?", word) and word.split("=", 1)[0] not in known:
            found.append(f"{argv[0]} {args[0]} has no option {word.split('=', 1)[0]}")
    return found


def test_every_documented_command_and_option_exists() -> None:
    """Bug: the docs named options and commands that the program did not have (or no longer had)."""
    seen, wrong = 0, []
    for path in DOCS:
        for number, text in shell_lines(path):
            for argv in invocations(text):
                seen += 1
                wrong += [f"{path.relative_to(REPO)}:{number}: {p}: {text.strip()}" for p in problems(argv)]
    assert seen >= 60, f"only {seen} commands found: is the parser still reading the docs?"
    assert wrong == [], "\n".join(wrong)


def test_the_check_catches_what_drifted() -> None:
    """The check itself can fail: an invented option, an invented command."""
    assert problems(["ddpctl", "--socket", "/s", "logs", "j1", "--follow-harder"]) == [
        "ddpctl logs has no option --follow-harder"]
    assert problems(["ddpctl", "launch", "j1"]) == ["ddpctl has no command 'launch'"]
    assert problems(["ddpctl", "submit", "--nproc", "2", "--", "train.py", "--lr", "0.1"]) == []
    assert invocations("J=$(ddpctl submit --nproc 2) && ddpctl wait $J") == [
        ["ddpctl", "submit", "--nproc", "2"], ["ddpctl", "wait", "$J"]]


def test_the_readme_by_hand_block_puts_both_programs_on_the_path() -> None:
    """Bug: `.venv/bin/ddpd serve &` then a bare `ddpctl` gave "command not found"."""
    readme = (REPO / "README.md").read_text()
    block = readme[readme.index("Using it by hand"):]
    first = next(line for line in block.split("```sh\n", 1)[1].splitlines() if line.strip())
    assert first.split("#")[0].strip() == "source .venv/bin/activate"
    venv = Path(sys.executable).parent
    if not (venv / "activate").is_file():
        pytest.skip("not run from a virtual environment")
    done = subprocess.run(["bash", "-c", f"source {venv}/activate && command -v ddpd && command -v ddpctl"],
                          capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, done.stderr
    assert [Path(p).parent for p in done.stdout.split()] == [venv, venv]
