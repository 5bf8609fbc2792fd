"""The launch document both gates read: what `launch_script` writes, the Python gate's `parse` reads
back byte for byte (dash runs the same lines: tests/integration/test_gate.py runs both gates on the
same hostile environment and compares what the child saw)."""

from __future__ import annotations

import pytest

from ddpd.daemon.contain.gate import launch_script, parse_launch, shell_carries

HOSTILE = [
    "", " ", "'", "''", '"', "'\"'\"'", "a b", "\n", "line one\nline two\n\nexport PWNED=1\n",
    "$(touch /tmp/x) `id` $HOME \\ ;|&<>*?[]{}~#!", "päivää 日本 \u200b", "=", "a=b=c", "</dev/null",
    "-C", "--", "exec", "\udcff\udc80 bytes that are not UTF-8", "x" * 100_000,
]


def _b(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")


@pytest.mark.parametrize("value", HOSTILE, ids=range(len(HOSTILE)))
def test_every_value_reads_back_as_written(value: str) -> None:
    env = {"V": value, "BASH_FUNC_f%%": "() {  echo " + value + "\n}", "EMPTY": "", "a b": value}
    argv = ["/usr/bin/python3", value, "-c", value, ""]
    cwd = "/" + value.replace("\n", "x").replace("\x00", "") if value else "/"
    umask, got_env, got_cwd, got_argv = parse_launch(launch_script(argv, env, cwd, 0o027))
    assert umask == 0o027
    assert got_env == {_b(k): _b(v) for k, v in env.items()}
    assert got_cwd == _b(cwd)
    assert got_argv == [_b(a) for a in argv]


def test_what_dash_cannot_export_goes_the_python_way() -> None:
    assert shell_carries({"PATH": "/bin", "_x1": ""})
    for name in ("BASH_FUNC_f%%", "a b", "1X", "OPTIND", "ä"):
        assert not shell_carries({name: "1"}), name


def test_the_launch_refuses_relative_paths() -> None:
    with pytest.raises(ValueError, match="argv\\[0\\]"):
        launch_script(["python"], {}, "/")
    with pytest.raises(ValueError, match="cwd"):
        launch_script(["/usr/bin/python3"], {}, "work")
