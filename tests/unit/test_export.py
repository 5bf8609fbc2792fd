"""The submitter's interpreter and environment in the spec: what ddpctl captures, and the bounds at the door."""

from __future__ import annotations

import sys

import click
import msgspec
import pytest

from ddpd.cli.specs import ENVIRON_BUDGET, exported, spec_from_options
from ddpd.protocol import JobSpec, SpecError, check_spec
from ddpd.protocol.spec import MAX_ENVIRON_TOTAL, MAX_ENVIRON_VALUE


def test_export_all_none_and_names() -> None:
    env = {"A": "1", "B": "2", "PATH": "/bin"}
    assert exported("ALL", env) == ("ALL", env)
    assert exported("none", env) == ("NONE", {})
    assert exported("A, PATH,MISSING", env) == ("A,PATH,MISSING", {"A": "1", "PATH": "/bin"})
    with pytest.raises(click.BadParameter, match="comma-separated"):
        exported(" , ", env)


def test_an_environment_too_large_for_a_request_is_refused_with_the_way_out() -> None:
    with pytest.raises(click.BadParameter, match="--export NAME"):
        exported("ALL", {"BIG": "x" * ENVIRON_BUDGET})


def test_submit_captures_the_interpreter_cwd_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDPD_TEST_EXPORTED", "hello")
    spec = spec_from_options({"env": ("K=V",)}, ())
    assert spec.python == sys.executable
    assert spec.export == "ALL"
    assert spec.environ is not None and spec.environ["DDPD_TEST_EXPORTED"] == "hello"
    assert spec.env == {"K": "V"}
    spec = spec_from_options({"python": "/opt/py/bin/python", "export": "NONE"}, ())
    assert (spec.python, spec.environ, spec.export) == ("/opt/py/bin/python", {}, "NONE")


def test_an_old_client_spec_has_no_interpreter_or_environment() -> None:
    spec = msgspec.json.decode(b'{"task": "two-layer"}', type=JobSpec)
    assert spec.python is None and spec.environ is None


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"python": "python3"}, "python"),
        ({"python": "/usr/bin/py\nthon"}, "python"),
        ({"environ": {"A=B": "x"}}, "environ"),
        ({"environ": {"A": "x\0y"}}, "environ.A"),
        ({"environ": {f"V{i}": "x" * (MAX_ENVIRON_VALUE - 10)
                      for i in range(MAX_ENVIRON_TOTAL // MAX_ENVIRON_VALUE + 1)}}, "environ"),
    ],
)
def test_bad_interpreter_or_environment_is_refused_naming_the_field(fields: dict[str, object], field: str) -> None:
    with pytest.raises(SpecError) as err:
        check_spec(JobSpec(**fields))  # type: ignore[arg-type]
    assert err.value.field.startswith(field)


def test_values_may_hold_newlines_as_exported_shell_functions_do() -> None:
    check_spec(JobSpec(environ={"BASH_FUNC_f%%": "() {  echo hi\n}"}))
