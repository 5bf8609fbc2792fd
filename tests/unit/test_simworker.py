"""The scale benchmark's simulated worker writes its frames itself and reads its Assign by hand (to
start in milliseconds): held here to the protocol's own types, both ways."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from ddpd.protocol import Decoder, JobSpec, encode
from ddpd.protocol.channel import Assign, Heartbeat, Hello, PhaseChanged, Progress, Result, Stop, WorkerMessage

SIMWORKER = Path(__file__).resolve().parents[2] / "benchmarks" / "simworker.py"


@pytest.fixture(scope="module")
def sim() -> ModuleType:
    spec = importlib.util.spec_from_file_location("simworker", SIMWORKER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_its_frames_are_the_protocols(sim: ModuleType) -> None:
    decoder: Decoder[WorkerMessage] = Decoder(WorkerMessage)
    frames = [sim.hello(7, 1234), sim.phase("joined"), sim.heartbeat(3), sim.progress(10), sim.result(12)]
    decoded = [decoder.decode_frame(f.rstrip(b"\n")) for f in frames]
    assert [type(m) for m in decoded] == [Hello, PhaseChanged, Heartbeat, Progress, Result]
    assert (decoded[0].version, decoded[0].pid) == (7, 1234)  # type: ignore[union-attr]
    assert decoded[3] == Progress(step=10, loss=0.1) and decoded[4] == Result(steps=12, stopped_early=True)


def test_it_reads_its_assignment_whatever_the_job_put_in_strings_and_keys(sim: ModuleType) -> None:
    spec = JobSpec(name='x "pgid":5 "heartbeat_interval":9', task="two-layer", nproc=2)
    assign = Assign(job_id="j1-abcd", attempt=1, rank=1, world_size=2, local_rank=1, local_world_size=2,
                    store_host="127.0.0.1", store_port=1, spec=spec, env={"pgid": "3", "heartbeat_interval": "8"},
                    heartbeat_interval=0.25, join_timeout=60.0, checkpoint_dir="/c", pgid=4242)
    line = encode(assign).rstrip(b"\n")
    assert sim.frame_type(line) == b"assign" and sim.frame_type(encode(Stop()).rstrip()) == b"stop"
    assert (sim.number(line, b"pgid"), sim.number(line, b"heartbeat_interval")) == (4242, 0.25)
