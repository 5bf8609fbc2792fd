"""Hostile requests against a real daemon: each is refused with a stable code naming the problem,
the daemon keeps answering ping, and no accepted job is lost."""

from __future__ import annotations

import anyio
import msgspec
import pytest

from ddpd.protocol import JobState
from ddpd.protocol.spec import MAX_WORLD

from ..conftest import DaemonProc
from ..rawclient import all_jobs, call, ping_within, send_raw

pytestmark = pytest.mark.anyio


def _submit(spec: bytes) -> bytes:
    return b'{"op":"submit","id":5,"spec":' + spec + b"}\n"


async def _accepted(d: DaemonProc) -> str:
    reply = await call(d.client, {"op": "submit", "spec": msgspec.to_builtins(d.spec(task="two-layer", steps=1))})
    assert reply["type"] == "ok", reply
    return str(reply["result"]["job_id"])


async def test_deep_nesting_gets_an_error_and_the_daemon_lives(door: DaemonProc) -> None:
    """The bug: a 5 KB submit with options nested 5,000 deep raised RecursionError in msgspec, which
    escaped to the root task group: the daemon died and every running job ended daemon_restart."""
    job_id = await _accepted(door)
    for depth in (33, 5_000, 30_000):
        nested = b"[" * depth + b"]" * depth
        replies = await send_raw(door.client, _submit(b'{"options":{"x":' + nested + b"}}"), expect=1)
        assert replies[0]["type"] == "error" and replies[0]["code"] == "bad_message", replies
        assert "nested" in replies[0]["message"]
        replies = await send_raw(door.client, b'{"op":"ping","id":' + nested + b"}\n", expect=1)
        assert replies[0]["code"] in ("bad_message", "frame_too_large"), replies
        await ping_within(door.client, 5)
    assert door.proc.returncode is None
    with anyio.fail_after(120):
        assert (await door.client.wait(job_id)).state == JobState.SUCCEEDED
    assert [j.id for j in await all_jobs(door.client)] == [job_id]


BAD_FIELDS = [
    (b'{"priority":9223372036854775808}', "bad_message", "$.spec.priority"),  # the bug: 2**63
    (b'{"priority":-9223372036854775809}', "bad_message", "$.spec.priority"),
    (b'{"seed":99999999999999999999999}', "bad_message", "$.spec.seed"),
    (b'{"steps":1e400}', "bad_message", "$.spec.steps"),
    (b'{"options":{"lr":1e400}}', "bad_message", "$.spec.options"),
    (b'{"options":{"lr":NaN}}', "malformed_frame", "malformed"),
    (b'{"env":{"FOO":"a\\u0000b"}}', "bad_spec", "env.FOO"),  # the bug: accepted, then internal_error
    (b'{"name":"x\\u0007"}', "bad_spec", "name"),
    (b'{"env":{"CUDA_VISIBLE_DEVICES":"0,1"}}', "bad_spec", "env.CUDA_VISIBLE_DEVICES"),
    (b'{"env":{"DDPD_ATTEMPT":"x"}}', "bad_spec", "env.DDPD_ATTEMPT"),
    (b'{"env":{"MASTER_PORT":"1"}}', "bad_spec", "env.MASTER_PORT"),
    (b'{"name":"' + b"n" * 60_000 + b'"}', "bad_message", "$.spec.name"),
    (b'{"name":"' + b"n" * 70_000 + b'"}', "frame_too_large", "exceeds"),
]


async def test_bad_fields_are_refused_naming_them(door: DaemonProc) -> None:
    for spec, code, names in BAD_FIELDS:
        replies = await send_raw(door.client, _submit(spec), expect=1)
        assert replies[0]["type"] == "error" and replies[0]["code"] == code, replies
        assert names in replies[0]["message"], replies
        assert replies[0]["id"] == (None if code in ("frame_too_large", "malformed_frame") else 5)
        await ping_within(door.client, 5)
    assert await all_jobs(door.client) == []  # nothing half-accepted
    job_id = await _accepted(door)  # and the next submit works (the bug: it killed the daemon)
    with anyio.fail_after(120):
        assert (await door.client.wait(job_id)).state == JobState.SUCCEEDED


async def test_a_bad_request_does_not_close_the_connection(door: DaemonProc) -> None:
    frames = (b'{"op":"status","id":1,"job_id":"' + b"j" * 100 + b'"}\n' + b'{"op":"list","id":2,"limit":-1}\n'
              + b'{"op":"logs","id":3,"job_id":"x","rank":' + str(MAX_WORLD).encode() + b'}\n'  # past every rank
              + b'{"op":"ping","id":4}\n')
    replies = await send_raw(door.client, frames, expect=4)
    assert [(r["id"], r["type"]) for r in replies] == [(1, "error"), (2, "error"), (3, "error"), (4, "ok")]
    assert {r.get("code") for r in replies[:3]} == {"bad_message"}


async def test_reload_with_a_bad_file_keeps_the_config(door: DaemonProc) -> None:
    """The bug: `[defaults] join = "120"` was accepted by reload, then every job failed."""
    config = door.state_dir.parent / "ddpd.toml"
    good = config.read_text()
    config.write_text(good + '[defaults]\njoin = "120"\n')
    reply = await call(door.client, {"op": "reload"})
    assert reply["type"] == "error" and reply["code"] == "bad_config", reply
    assert "defaults.join" in reply["message"]
    config.write_text(good)
    job_id = await _accepted(door)
    with anyio.fail_after(120):
        assert (await door.client.wait(job_id)).state == JobState.SUCCEEDED
