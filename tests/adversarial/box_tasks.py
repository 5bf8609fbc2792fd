"""Task factories of the shared-box suite, importable as ``tests.adversarial.box_tasks:<factory>``:
what a hostile rank does to the daemon that supervises it."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

from ddpd.worker.tasks import Task, TaskContext, two_layer


def _channel_fd() -> int:
    return int(sys.argv[sys.argv.index("--fd") + 1])  # the worker's inherited channel socket


def _at_step_one(ctx: TaskContext, action: object) -> Task:
    assert callable(action)
    return dataclasses.replace(two_layer(ctx), on_step=lambda step: action() if step == 1 else None)


def event_flood(ctx: TaskContext) -> Task:
    """At step 1: `options["joins"]` (1000) join phases again and `options["checkpoints"]` (800)
    checkpoint frames naming a 4,000-character path, within the frame budget; prints ``FLOODED``."""
    from ddpd.protocol import encode
    from ddpd.protocol.channel import Checkpointed, PhaseChanged

    fd = _channel_fd()
    joined = encode(PhaseChanged(phase="joined"))
    ckpt = encode(Checkpointed(step=1, path="/ckpt/" + "p" * 4000))

    def flood() -> None:
        for _ in range(int(ctx.options.get("joins", 1000))):
            os.write(fd, joined)  # one frame per write: the heartbeat thread writes whole frames too
        for _ in range(int(ctx.options.get("checkpoints", 800))):
            os.write(fd, ckpt)
        print("FLOODED", flush=True)

    return _at_step_one(ctx, flood)


def orphan_children(ctx: TaskContext) -> Task:
    """At step 1: `options["count"]` (100) shells that each leave a short `sleep` behind and exit,
    never waited for (so both are orphaned to the daemon when the rank exits); prints ``ORPHANED``."""
    count = int(ctx.options.get("count", 100))

    def spawn() -> None:
        for _ in range(count):
            subprocess.Popen(["/bin/sh", "-c", "sleep 0.2 &"], stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        print("ORPHANED", flush=True)

    return _at_step_one(ctx, spawn)
