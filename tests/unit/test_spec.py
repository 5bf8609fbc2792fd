"""The job spec at the door: every field bounded, control characters and reserved variables refused,
with a message naming the field."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from ddpd.protocol import RESERVED_ENV, RESERVED_ENV_PREFIXES, FrameError, JobSpec, SpecError, check_spec
from ddpd.protocol.control import Cancel, Events, ListJobs, Logs, Request, Submit
from ddpd.protocol.framing import Decoder
from ddpd.protocol.spec import MAX_ENV, MAX_OPTIONS, PRIORITY_LIMIT

_request: Decoder[Request] = Decoder(Request)


def _decode(spec: dict[str, Any]) -> JobSpec:
    frame = msgspec.json.encode({"op": "submit", "id": 1, "spec": spec}).replace(b'"@1e400"', b"1e400")
    req = _request.decode_frame(frame)
    assert isinstance(req, Submit)
    return check_spec(req.spec)


@pytest.mark.parametrize(("spec", "field"), [
    ({"priority": 2**63}, "priority"),  # the bug: stored 64 bits, failed the save, then killed the daemon
    ({"priority": PRIORITY_LIMIT}, "priority"),
    ({"priority": -PRIORITY_LIMIT}, "priority"),
    ({"seed": 2**64}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"steps": 10**10}, "steps"),
    ({"steps": -1}, "steps"),
    ({"checkpoint_every": 2**63}, "checkpoint_every"),
    ({"nproc": 1025}, "nproc"),
    ({"nproc": 0}, "nproc"),
    ({"timeouts": {"join": "@1e400"}}, "timeouts.join"),
    ({"timeouts": {"wall": 0}}, "timeouts.wall"),
    ({"options": {"x": "@1e400"}}, "options"),
    ({"options": {"x": 2**70}}, "options"),
    ({"options": {"x": "y" * 5000}}, "options"),
    ({"options": {str(i): i for i in range(MAX_OPTIONS + 1)}}, "options"),
    ({"options": {"x": [1]}}, "options"),
    ({"env": {f"V{i}": "1" for i in range(MAX_ENV + 1)}}, "env"),
    ({"env": {"V": "x" * 20_000}}, "env"),
    ({"name": "n" * 201}, "name"),
    ({"task": "t" * 201}, "task"),
    ({"workdir": "/" + "w" * 5000}, "workdir"),
    ({"script": ["a"] * 257}, "script"),
    ({"script": ["a", "b" * 5000]}, "script"),
    ({"after": [f"j{i}" for i in range(33)]}, "after"),
    ({"after": [""]}, "after"),
    ({"after": ["j" * 65]}, "after"),
])
def test_out_of_bounds_fields_are_refused_at_decode(spec: dict[str, Any], field: str) -> None:
    with pytest.raises(FrameError) as err:
        _decode(spec)
    assert err.value.code == "bad_message"
    assert f"$.spec.{field}" in err.value.message, err.value.message


@pytest.mark.parametrize(("spec", "field"), [
    ({"env": {"FOO": "a\x00b"}}, "env.FOO"),  # the bug: accepted, then failed late as internal_error
    ({"env": {"FOO": "line\nbreak"}}, "env.FOO"),
    ({"name": "x\x1b[31m"}, "name"),
    ({"workdir": "/tmp/a\x00b"}, "workdir"),
    ({"script": ["/bin/x", "a\x00"]}, "script[1]"),
    ({"task": "mod:fac\x00"}, "task"),
    ({"options": {"k\x00": 1}}, "options."),
    ({"options": {"x": float("nan")}}, "options.x"),
    ({"options": {"x": float("inf")}}, "options.x"),
    ({"env": {"1BAD": "x"}}, "env.1BAD"),
])
def test_control_characters_and_bad_values_name_the_field(spec: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError) as err:
        check_spec(JobSpec(**spec))
    assert str(err.value).startswith(field), str(err.value)


@pytest.mark.parametrize("key", [*sorted(RESERVED_ENV), *(p + "ATTEMPT" for p in RESERVED_ENV_PREFIXES)])
def test_reserved_env_keys_are_refused_naming_the_key(key: str) -> None:
    with pytest.raises(SpecError) as err:
        check_spec(JobSpec(env={key: "1"}))
    assert err.value.field == f"env.{key}" and "set by the daemon" in str(err.value)


def test_a_valid_spec_passes_and_keeps_its_values() -> None:
    spec = _decode({"name": "ünïcode ✓", "env": {"OMP_NUM_THREADS": "1", "MY_VAR": "a b=c"},
                    "options": {"lr": 0.1, "n": -(2**63), "flag": True, "s": "x"}, "priority": PRIORITY_LIMIT - 1,
                    "seed": 2**63 - 1})
    assert spec.task == "two-layer" and spec.options["n"] == -(2**63) and spec.seed == 2**63 - 1


def test_env_tab_is_a_control_character_too() -> None:
    with pytest.raises(SpecError, match=r"env\.MY_VAR"):
        check_spec(JobSpec(env={"MY_VAR": "a\tb"}))


@pytest.mark.parametrize("frame", [
    {"op": "list", "id": 1, "limit": 0},
    {"op": "list", "id": 1, "before": -1},
    {"op": "list", "id": 2**64},
    {"op": "logs", "id": 1, "job_id": "j", "rank": 1024 * 4096},  # past every global rank (MAX_WORLD)
    {"op": "stacks", "id": 1, "job_id": "j", "rank": 1024 * 4096},
    {"op": "logs", "id": 1, "job_id": "j", "attempt": 0},
    {"op": "events", "id": 1, "since": -1},
    {"op": "events", "id": 1, "limit": 10**6},
    {"op": "status", "id": 1, "job_id": "j" * 65},
    {"op": "cancel", "id": 1, "job_id": ""},
    {"op": "submit", "id": 1, "spec": {}, "idempotency_key": "a b"},
    {"op": "submit", "id": 1, "spec": {}, "idempotency_key": "k" * 129},
])
def test_request_fields_are_bounded(frame: dict[str, Any]) -> None:
    with pytest.raises(FrameError):
        _request.decode_frame(msgspec.json.encode(frame))


def test_request_defaults() -> None:
    assert _request.decode_frame(b'{"op":"list","id":1}') == ListJobs(id=1, all=True, limit=200, before=None)
    assert _request.decode_frame(b'{"op":"events","id":1}') == Events(id=1)
    assert _request.decode_frame(b'{"op":"logs","id":1,"job_id":"j"}') == Logs(id=1, job_id="j")
    assert _request.decode_frame(b'{"op":"cancel","id":1,"job_id":"j"}') == Cancel(id=1, job_id="j")
