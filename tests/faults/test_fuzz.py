"""Bad input, fuzzed: the control socket and a worker's channel get garbage; the daemon answers with
errors or hangs up on that connection, keeps serving the others, and its state stays intact."""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import msgspec
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ddpd.protocol import MAX_FRAME, MAX_REQUEST, JobState

from ..conftest import DaemonProc, assert_nothing_left
from ..rawclient import all_jobs, serving_daemon
from .helpers import events_of

pytestmark = pytest.mark.anyio


@pytest.fixture
async def door(short_tmp: Path) -> AsyncIterator[DaemonProc]:
    async with serving_daemon(short_tmp) as d:
        yield d


# ops whose valid forms may legitimately keep a connection open (wait, follow streams) or start work
# (submit) are only sent with fields of the wrong type
OPS = ["hello", "status", "list", "cancel", "logs", "events", "ping", "daemon", "submit", "wait", "frobnicate"]
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
not_bool = json_values.filter(lambda v: not isinstance(v, bool))
wrong_types = st.fixed_dictionaries(
    {"op": st.sampled_from(OPS)},
    optional={"id": json_values, "job_id": json_values, "spec": not_bool.filter(lambda v: not isinstance(v, dict)),
              "follow": not_bool, "version": json_values, "rank": json_values, "limit": json_values},
)
unknown_fields = st.tuples(st.sampled_from([{"op": "ping", "id": 1}, {"op": "list", "id": 2}, {"op": "hello", "id": 3,
                                                                                           "version": 1}]),
                           st.text(min_size=1, max_size=10).filter(lambda k: k not in ("op", "id", "version")),
                           json_values).map(lambda t: {**t[0], t[1]: t[2]})
valid = [b'{"op":"ping","id":1}\n', b'{"op":"list","id":2}\n', b'{"op":"status","id":3,"job_id":"nope"}\n']

# hostile values: huge and negative integers, non-finite floats (as JSON cannot spell them, and as
# msgspec would overflow), NUL and other control characters, any unicode, giant strings and lists
huge_ints = st.integers(-(2**70), 2**70) | st.sampled_from([2**63, 2**63 - 1, -(2**63) - 1, 2**64, -1, 0])
floats = st.floats(allow_nan=False, allow_infinity=False) | st.sampled_from([0.0, -0.0, 1e308])
texts = (st.text(max_size=40) | st.text(alphabet=st.characters(max_codepoint=0x1F), max_size=8)
         | st.sampled_from(["\x00", "a\x00b", "\u202e", "\U0001f600", "\ufeff"]))
giant = st.integers(1, 2 * MAX_REQUEST).map(lambda n: "x" * n) | st.integers(1, 20_000).map(lambda n: [0] * n)
hostile = st.recursive(st.none() | st.booleans() | huge_ints | floats | texts | giant,
                       lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
                       max_leaves=12)
SPEC_FIELDS = ["name", "task", "nproc", "steps", "seed", "priority", "checkpoint_every", "env", "workdir",
               "options", "timeouts", "gpus_per_rank", "max_restarts", "device"]
# a submit that can never be accepted (its task does not exist), with hostile values in every field
hostile_specs = st.dictionaries(st.sampled_from(SPEC_FIELDS), hostile, max_size=6).map(
    lambda spec: {**spec, "task": "no such task"})
env_specs = st.dictionaries(texts | st.sampled_from(["RANK", "MASTER_PORT", "DDPD_X", "CUDA_VISIBLE_DEVICES"]),
                            texts, min_size=1, max_size=4).map(lambda env: {"env": env, "task": "no such task"})
hostile_requests = st.fixed_dictionaries(
    {"op": st.sampled_from(OPS)},
    optional={"id": hostile, "job_id": hostile, "limit": hostile, "before": hostile, "since": hostile,
              "rank": hostile, "attempt": hostile, "all": hostile, "idempotency_key": hostile},
).filter(lambda d: d["op"] not in ("wait", "submit") or "job_id" not in d or not isinstance(d["job_id"], str))
JSON_SPELLINGS = [b"NaN", b"Infinity", b"-Infinity", b"1e400", b"-1e400", b"99999999999999999999999999"]


def _encode(value: object) -> bytes:
    return json.dumps(value).encode() + b"\n"


def _deep(depth: int, field: bytes) -> bytes:
    nested = b"[" * depth + b"]" * depth
    return b'{"op":"submit","id":1,"spec":{"task":"no such task","' + field + b'":' + nested + b"}}\n"


payloads = st.one_of(
    st.binary(max_size=1024),
    st.sampled_from(valid).flatmap(lambda b: st.integers(0, len(b) - 1).map(lambda n: b[:n])),
    st.integers(1, 200_000).map(lambda depth: b"[" * depth + b"]" * depth + b"\n"),
    st.integers(1, 200_000).map(lambda depth: b'{"op":"ping","id":' + b"[" * depth + b"\n"),
    wrong_types.map(lambda d: json.dumps(d).encode() + b"\n"),
    unknown_fields.map(lambda d: json.dumps(d).encode() + b"\n"),
    st.lists(st.sampled_from(valid) | st.binary(max_size=64), max_size=5).map(b"".join),
    hostile_specs.map(lambda spec: _encode({"op": "submit", "id": 1, "spec": spec})),
    env_specs.map(lambda spec: _encode({"op": "submit", "id": 1, "spec": spec})),
    hostile_requests.filter(lambda d: d["op"] != "submit").map(_encode),
    st.tuples(st.integers(1, 60_000), st.sampled_from([b"options", b"env", b"name", b"script", b"timeouts"])).map(
        lambda t: _deep(*t)),
    st.tuples(st.sampled_from([b"priority", b"seed", b"steps", b"nproc", b"options\":{\"x"]),
              st.sampled_from(JSON_SPELLINGS)).map(
        lambda t: b'{"op":"submit","id":1,"spec":{"task":"no such task","' + t[0] + b'":' + t[1] + b"}}\n"),
    st.sampled_from(JSON_SPELLINGS).map(lambda n: b'{"op":"list","id":1,"limit":' + n + b"}\n"),
)


def _exchange(path: str, payload: bytes) -> list[dict[str, object]]:
    """Send `payload`, half-close, read every reply until the daemon closes (bounded)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(20)
        sock.connect(path)
        try:
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # it may hang up on a bad frame before reading it all
        data = b""
        while True:
            try:
                chunk = sock.recv(1 << 16)
            except ConnectionResetError:
                break
            if not chunk:
                break
            data += chunk
    replies = [json.loads(line) for line in data.split(b"\n") if line]
    assert all(isinstance(r, dict) and r.get("type") in ("ok", "error", "item", "end") for r in replies), replies
    return replies


async def test_control_socket_fuzzed(door: DaemonProc) -> None:
    daemon = door
    before = await daemon.run(daemon.spec(task="two-layer", nproc=1, steps=2))
    assert before.state == JobState.SUCCEEDED
    events_before = await events_of(daemon, before.id)
    path = str(daemon.socket)
    internal: list[tuple[bytes, dict[str, object]]] = []

    @settings(max_examples=500, deadline=None, suppress_health_check=list(HealthCheck))
    @given(payloads)
    @example(b'{"op":"ping","id":1,"pad":"' + b"x" * MAX_FRAME + b'"}\n')
    @example(b"x" * (MAX_FRAME + 10))
    @example(b"\xff\xfe\n" + b'{"op":"ping","id":1}\n')
    @example(b'{"op":"status","id":1,"job_id":"' + before.id.encode() + b'","extra":1}\n')
    @example(b'{"op":"logs","id":1,"job_id":"' + before.id.encode() + b'","rank":-1}\n')
    @example(b'{"op":"logs","id":1,"job_id":"' + before.id.encode() + b'","attempt":-5}\n')
    @example(b'{"op":"list","id":1,"limit":-1}\n')
    @example(b'{"op":"submit","id":1,"spec":{"nproc":2000000}}\n')
    @example(b'{"op":"submit","id":1,"spec":{"steps":1e400}}\n')
    @example(_deep(5_000, b"options"))  # the bug: RecursionError killed the daemon
    @example(b'{"op":"submit","id":1,"spec":{"priority":9223372036854775808}}\n')
    @example(b'{"op":"submit","id":1,"spec":{"env":{"A":"\\u0000"}}}\n')
    def fuzz(payload: bytes) -> None:
        for reply in _exchange(path, payload):
            if reply.get("code") == "internal":
                internal.append((payload[:200], reply))
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:  # others are still served
            probe.settimeout(20)
            probe.connect(path)
            probe.sendall(b'{"op":"ping","id":9}\n')
            assert b'"pong"' in probe.recv(1024)

    async with daemon.client.connect() as other:  # one connection open throughout
        await anyio.to_thread.run_sync(fuzz)
        assert (await other.call({"op": "ping"})) == "pong"
    assert internal == [], internal
    # the state is intact: the same jobs, the same job, the same events; and new work runs
    jobs = await all_jobs(daemon.client)
    assert [j.id for j in jobs] == [before.id]
    after = await daemon.client.status(before.id)
    assert msgspec.structs.replace(after, ranks=[]) == msgspec.structs.replace(before, ranks=[])
    assert [(r.state, r.checksum) for r in after.ranks] == [(r.state, r.checksum) for r in before.ranks]
    assert await events_of(daemon, before.id) == events_before
    job = await daemon.run(daemon.spec(task="two-layer", nproc=1, steps=2))
    assert job.state == JobState.SUCCEEDED
    assert_nothing_left([before, job])


CHANNEL_GARBAGE = {
    "malformed": ({"garbage": "{not json"}, "malformed JSON"),
    "unknown-type": ({"garbage": '{"type":"nope"}'}, "invalid message"),
    "wrong-type": ({"garbage": '{"type":"progress","step":"x"}'}, "invalid message"),
    "second-hello": ({"garbage": '{"type":"hello","version":1,"pid":1,"python":"x"}'}, "out-of-order"),
    "huge-step": ({"garbage": '{"type":"progress","step":18446744073709551615}'}, "step out of range"),
    "deep": ({"garbage": "[" * 4_000}, "invalid message"),  # an option value holds 4096 characters at most
    "too-large": ({"garbage_size": MAX_FRAME + 1}, "exceeds"),
}


@pytest.mark.slow
async def test_worker_channel_garbage_end_to_end(door: DaemonProc) -> None:
    """A real rank writes garbage onto its channel mid-training: that job fails with a protocol error
    naming the rank; the daemon and a healthy job next to it are untouched."""
    daemon = door
    healthy = await daemon.client.submit(daemon.spec(task="tests.tasks:slow", nproc=1, steps=200,
                                                     options={"step_sleep": 0.02}))
    ids = {name: await daemon.client.submit(daemon.spec(task="tests.tasks:garbage_to_daemon", nproc=1,
                                                        steps=100_000, options={**opts, "at_step": 2}))
           for name, (opts, _) in CHANNEL_GARBAGE.items()}
    with anyio.fail_after(300):
        jobs = {name: await daemon.client.wait(job_id) for name, job_id in ids.items()}
        ok = await daemon.client.wait(healthy)
    for name, job in jobs.items():
        rc = job.root_cause
        assert job.state == JobState.FAILED and rc is not None, (name, job.state, rc)
        assert rc.reason == "protocol_error" and rc.rank == 0, (name, rc)
        assert CHANNEL_GARBAGE[name][1] in (rc.detail or ""), (name, rc)
    assert ok.state == JobState.SUCCEEDED
    assert await daemon.client.ping() > 0
    assert_nothing_left([*jobs.values(), ok])
