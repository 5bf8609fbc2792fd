"""Paired segments: ddpd's steps per second against torchrun's, with the machine's drift cancelled.

    python -m benchmarks.paired                       # both models, 100 rounds each, 2 ranks
    python -m benchmarks.paired --models tiny --rounds 60
    python -m benchmarks.paired --models tiny --ranks 1   # a core spare per side on 2 cores
    python -m benchmarks.paired --models tiny --ranks 1 --warmup 20000   # past a forked rank's first seconds
    python -m benchmarks --only paired                # in the suite (--short: 40 rounds)

Whole runs one after the other (benchmarks/loop.py) compare rates measured seconds apart, and on a
shared 2-core machine the rate of one torchrun drifts by a third within a single run (the tiny
model's 500-step stretches: 420 to 860 steps/s): a 2% target drowns in that. Here every side is
started at once and they take turns (`SIDES`): the bare loop (``loop.py --bare``) as an unmodified
script under a default-config daemon (``ddpd``: submitted right after a short job, so its warm pool
refills behind it, as back to back), the same under a daemon without a pool (``ddpd (cold)``),
ddpd's built-in mlp task (``ddpd (task)``), and the bare loop under torchrun, twice (``torchrun
(again)`` is the method's own spread), and under ``chrt -b 0 torchrun`` (``torchrun (batch)``:
torchrun and its ranks at SCHED_BATCH, the policy ddpd gives CPU ranks; on a machine whose every
core is busy that policy, not the launcher, makes most of the difference). Each rank waits at a FIFO
gate (benchmarks/gate.py) before every segment of N steps; the driver opens one side's gates, waits
for rank 0's segment rate, then the next side's. A round is one segment per side, in an order that
turns from round to round (`order`); a side's ratio in a round is its segment's rate over torchrun's
in the same round, a second or so apart.

Every side is started, one after the other (each runs its warm-up alone), and at its first gate
before the rounds begin; then the driver waits for every daemon's pool to be idle and the machine to
be quiet (benchmarks/settle.py) once, for all sides alike, so no refill runs during the first
rounds. A side that fails (its job or torchrun ends badly, or its rank 0 goes silent) is dropped
from the later rounds and shown with its reason.

Reported per model (benchmarks/paired_table.py): the cores and ranks per side, each side's
scheduling policy (as its rank 0 reads it), its segment rates, and the median of its per-round
ratios to each torchrun (as started, and at SCHED_BATCH) with a distribution-free 95% interval
(order statistics, binomial): the target is a median >= 0.98 of torchrun's.
This is the steady training loop under each launcher, with the daemon supervising and a refill
held behind the job: the start of a job, and whatever a refill does before the job's ranks take
the cores, are the back-to-back benchmark's (benchmarks/loop.py). CPU only.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import anyio

from .common import TORCHRUN, BenchError, Daemon, free_port, start_daemon, stop_daemon, why
from .paired_table import describe, summarise
from .settle import settle

LOOP = str(Path(__file__).resolve().with_name("loop.py"))
REPO = Path(LOOP).parent.parent
# side: (how it runs, the daemon it runs on). "ddpd": the bare loop as a script, submitted right
# after a short job (its pool refilling behind it); "ddpd (cold)": the same without a pool; "ddpd
# (task)": the built-in mlp task; "ddpd (forked)": the bare loop on ranks a fork server forked
# (``pool_fork_server``; also after a short job); "torchrun (again)": a second torchrun, the method's own spread;
# "torchrun (batch)": torchrun under `chrt -b 0` (it and its ranks at SCHED_BATCH).
SIDES = {"ddpd": ("script", "pooled"), "ddpd (cold)": ("script", "cold"), "ddpd (task)": ("task", "task"),
         "ddpd (forked)": ("script", "forked"),
         "torchrun": ("torchrun", ""), "torchrun (again)": ("torchrun", ""), "torchrun (batch)": ("torchrun", "batch")}
CHRT_BATCH = ("chrt", "-b", "0")
REFERENCE = "torchrun"
# (label, layers, width, batch, warm-up steps, steps per segment): segments of a fifth of a second
MODELS = {"tiny": ("tiny", 2, 32, 8, 200, 120), "4x1024": ("4x1024", 4, 1024, 64, 10, 6)}
READY_TIMEOUT = 300.0
SEGMENT_TIMEOUT = 120.0


class Lines:
    """Lines read from a FIFO the driver holds open read-write (so it never sees end of file)."""

    def __init__(self, fd: int) -> None:
        self.fd, self.buffer = fd, b""

    async def next(self) -> str:
        while b"\n" not in self.buffer:
            await anyio.wait_readable(self.fd)
            try:
                self.buffer += os.read(self.fd, 4096)
            except BlockingIOError:
                continue
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line.decode()


@dataclass
class Side:
    """One launcher's gated job: its FIFOs, what rank 0 said, and how to end it."""

    name: str
    directory: Path
    nproc: int
    go: list[int] = field(default_factory=list)
    done: Lines | None = None
    rates: list[float] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None  # torchrun
    daemon: Daemon | None = None
    job_id: str = ""
    policy: str = "?"  # the scheduling policy rank 0 reported
    failed: str = ""  # why the side stopped early ("" while it runs)

    def make_fifos(self) -> None:
        self.directory.mkdir(parents=True)
        for name in [f"go-{r}" for r in range(self.nproc)] + ["done"]:
            os.mkfifo(self.directory / name, 0o600)
        self.go = [os.open(self.directory / f"go-{r}", os.O_RDWR | os.O_CLOEXEC) for r in range(self.nproc)]
        self.done = Lines(os.open(self.directory / "done", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC))

    async def said(self, timeout: float) -> str:
        assert self.done is not None
        with anyio.move_on_after(timeout):
            return await self.done.next()
        raise BenchError(f"{self.name}: rank 0 said nothing for {timeout:.0f}s{await self.why()}")

    async def segment(self) -> float:
        for fd in self.go:
            os.write(fd, b"g")
        rate = float(await self.said(SEGMENT_TIMEOUT))
        self.rates.append(rate)
        return rate

    async def why(self) -> str:
        if self.proc is not None and self.proc.poll() is not None:
            return f" (torchrun exited with {self.proc.returncode})"
        if self.daemon is not None and self.job_id:
            view = await self.daemon.client.status(self.job_id)
            return f" (job {self.job_id} {view.state}: {why(view.root_cause)})"
        return ""

    def close(self) -> None:
        for fd in self.go:
            os.close(fd)  # a rank still gated reads end of file and finishes ungated
        self.go = []
        if self.done is not None:
            os.close(self.done.fd)
            self.done = None


Model = tuple[str, int, int, int, int, int]


def bare_argv(model: Model, steps: int, extra: Sequence[str] = ()) -> list[str]:
    _, layers, width, batch, warmup, _ = model
    return [LOOP, "--bare", "--layers", str(layers), "--width", str(width), "--batch", str(batch),
            "--steps", str(steps), "--warmup", str(warmup), *extra]


async def submit(d: Daemon, model: Model, steps: int, side: Side | None, kind: str, nproc: int) -> str:
    """A job of the bare loop as a script (`kind` "script"), or of the gated built-in mlp task."""
    from ddpd.protocol import JobSpec

    if kind == "task":
        assert side is not None
        _, layers, width, batch, warmup, segment = model
        rounds = (steps - warmup - 1) // segment
        spec = JobSpec(name="bench-paired", task="benchmarks.gate:gated_mlp", nproc=nproc, steps=steps,
                       workdir=str(REPO), options={"layers": layers, "width": width, "batch": batch,
                                                   "gate": str(side.directory), "segment": segment,
                                                   "warmup": warmup, "rounds": rounds})
    else:
        extra = ["--gate", str(side.directory), "--segment", str(model[5])] if side else []
        spec = JobSpec(name="bench-paired", script=bare_argv(model, steps, extra), nproc=nproc, workdir=str(REPO))
    return str(await d.client.submit(spec))


def start_torchrun(model: Model, steps: int, side: Side, nproc: int, batch: bool) -> subprocess.Popen[bytes]:
    argv = bare_argv(model, steps, ["--gate", str(side.directory), "--segment", str(model[5])])
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc))}
    with (side.directory / "torchrun.log").open("wb") as log:
        launcher = [*(CHRT_BATCH if batch else ()), TORCHRUN]
        return subprocess.Popen([*launcher, "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
                                 "--master-port", str(free_port()), *argv], env=env, stdin=subprocess.DEVNULL,
                                stdout=log, stderr=log, start_new_session=True)


async def start_sides(base: Path, model: Model, rounds: int, nproc: int,
                      daemons: dict[str, Daemon]) -> tuple[dict[str, Side], str]:
    """Every side's gated job, started and at its first gate, ddpd's right after a short job took
    its pool's ready interpreters (the pool refills while the gated job runs); then the settle, whose
    outcome is returned in words."""
    from benchmarks.back_to_back import pool_settled

    warmup, segment = model[4], model[5]
    steps = warmup + rounds * segment
    sides = {name: Side(name, base / f"{model[0]}-{name.replace(' ', '-').strip('()')}", nproc) for name in SIDES}
    for side in sides.values():
        side.make_fifos()
    for key in ("pooled", "task"):
        await pool_settled(daemons[key])
    await pool_settled(daemons["forked"], 1)  # its fork server
    for key in ("pooled", "forked"):
        short = await submit(daemons[key], model, warmup + 1, None, "script", nproc)
        view = await daemons[key].client.wait(short)
        if view.state != "SUCCEEDED":
            raise BenchError(f"ddpd: the short job {short} ended {view.state}: {why(view.root_cause)}")
    for name, side in sides.items():  # one at a time: each warms up alone (2 x 7 threads would share 2 cores)
        kind, daemon = SIDES[name]
        if kind == "torchrun":
            side.proc = start_torchrun(model, steps, side, nproc, batch=daemon == "batch")
        else:
            side.daemon = daemons[daemon]
            side.job_id = await submit(side.daemon, model, steps + (kind == "task"), side, kind, nproc)
        word, _, side.policy = (await side.said(READY_TIMEOUT)).partition(" ")
        if word != "ready":
            raise BenchError(f"{side.name}: rank 0 said {word!r}, not ready")
    settled = await settle(daemons.values())  # once, for every side: no refill during the first rounds
    print(f"paired, {model[0]}: every side at its first gate; {settled.text()}", flush=True)
    return sides, settled.text()


async def run_rounds(sides: dict[str, Side], rounds: int) -> None:
    """`rounds` rounds of one segment per side in turn; a side that fails is dropped from the rest,
    with its reason (the others go on)."""
    for n in range(rounds):
        for name in order(list(sides), n):
            side = sides[name]
            if side.failed:
                continue
            try:
                await side.segment()
            except BenchError as exc:
                side.failed = f"in round {n + 1}: {exc}"
                side.close()


async def finish_sides(sides: dict[str, Side]) -> None:
    """Let every side run out ungated and end; a side whose job or torchrun did not succeed is failed
    (with why), as a side that failed during the rounds is."""
    for side in sides.values():
        side.close()
    for side in sides.values():
        if side.proc is not None:
            rc = await anyio.to_thread.run_sync(partial(side.proc.wait, timeout=300))
            if rc != 0 and not side.failed:
                side.failed = f"torchrun exited with {rc} (log: {side.directory / 'torchrun.log'})"
        elif side.daemon is not None and side.job_id:
            view = await side.daemon.client.wait(side.job_id)
            if view.state != "SUCCEEDED" and not side.failed:
                side.failed = f"job {side.job_id} ended {view.state}: {why(view.root_cause)}"


def kill_sides(sides: dict[str, Side]) -> None:
    for side in sides.values():
        side.close()
        if side.proc is not None and side.proc.poll() is None:
            os.killpg(side.proc.pid, signal.SIGKILL)
            side.proc.wait()


def order(names: Sequence[str], n: int) -> list[str]:
    """Round `n`'s order: the sides rotated by n, reversed every other cycle (each side takes each
    place, and follows each other side, equally often over two cycles)."""
    k = n % len(names)
    turned = list(names[k:]) + list(names[:k])
    return turned[::-1] if (n // len(names)) % 2 else turned


def cores() -> int:
    """The cores this run may use (its affinity), as the table states them."""
    return len(os.sched_getaffinity(0))


async def paired(models: Sequence[Model], rounds: int, nproc: int = 2) -> list[dict[str, Any]]:
    """Per model: every side started, `rounds` rounds of one segment each, the sides run out."""
    slots = max(nproc, os.cpu_count() or 1)
    results = []
    with tempfile.TemporaryDirectory(prefix="ddpd-paired-") as tmp:
        base = Path(tmp)
        daemons: dict[str, Daemon] = {}
        try:
            # "pooled" and "task": whole warm interpreters (the fork server, the default pool, is "forked")
            whole: dict[str, Any] = {"pool_fork_server": False}
            for key, config in (("pooled", whole), ("cold", {"pool_size": 0}), ("task", whole),
                                ("forked", {"pool_fork_server": True})):
                daemons[key] = await start_daemon(base, key, config={"cpu_slots": slots, **config})
            for model in models:
                sides, settled = await start_sides(base, model, rounds, nproc, daemons)
                try:
                    await run_rounds(sides, rounds)
                    await finish_sides(sides)
                finally:
                    kill_sides(sides)
                results.append(summarise(model[0], {n: s.rates for n, s in sides.items()},
                                         {n: s.policy for n, s in sides.items()},
                                         {n: s.failed for n, s in sides.items() if s.failed}, nproc, cores(),
                                         settled))
                print(describe(results[-1]), flush=True)
        finally:
            for d in daemons.values():
                await stop_daemon(d)
    return results


SHORT_ROUNDS, FULL_ROUNDS = 40, 100


async def bench_paired(ctx: Any) -> None:
    """The suite's entry (``BENCHES["paired"]``): per model, 2 ranks (every core of a 2-core machine
    busy), each side's segment rates (``paired.<model>``) and its per-round ratios to torchrun's
    (``paired.<model>.ratio``) and to torchrun at SCHED_BATCH's (``paired.<model>.ratio_batch``);
    then the tiny model with 1 rank per side (``paired.tiny.1rank``: cores to spare)."""
    rounds = SHORT_ROUNDS if ctx.plan.short else FULL_ROUNDS
    results = await paired(list(MODELS.values()), rounds)
    results += [{**r, "model": f"{r['model']}.1rank"} for r in await paired([MODELS["tiny"]], rounds, nproc=1)]
    for result in results:
        record_paired(ctx, result)


def record_paired(ctx: Any, result: dict[str, Any]) -> None:
    label, ranks = result["model"], result["ranks"]
    rates = ctx.results.metric(f"paired.{label}", "paired", f"paired segments: steps/s ({label}, {ranks} rank(s), "
                               f"{result['cores']} cores, CPU)", "steps/s", higher_is_better=True)
    for side, values in result["rates"].items():
        for v in values:
            rates.add(side, v)
    for key, reference in (("ratio", "torchrun"), ("ratio_batch", "torchrun (batch)")):
        ratio = ctx.results.metric(f"paired.{label}.{key}", "paired", f"paired: ÷ {reference}'s, per round ({label})",
                                   "x", higher_is_better=True)
        for side, summary in result["vs"].get(reference, {}).items():
            for v in summary["values"]:
                ratio.add(side, v)
    for side, reason in result["failed"].items():
        rates.fail(side, reason)
    rates.notes.append(describe(result))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.paired")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {','.join(MODELS)}")
    p.add_argument("--rounds", type=int, default=FULL_ROUNDS)
    p.add_argument("--segment", type=int, help="steps per segment (default: a fifth of a second's worth per model)")
    p.add_argument("--ranks", type=int, default=2, help="ranks per side (2 on a 2-core machine: every core busy; "
                   "1: a core to spare)")
    p.add_argument("--warmup", type=int, help="steps before the first segment (default: 200 for tiny, 10 for "
                   "4x1024; more to leave a forked rank's first seconds out: benchmarks/forked_ramp.py)")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    labels = args.models.split(",")
    if unknown := [m for m in labels if m not in MODELS]:
        p.error(f"unknown model(s) {unknown}; choose from {list(MODELS)}")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.ranks < 1:
        p.error("--ranks must be at least 1")
    if args.segment is not None and args.segment < 2:
        p.error("--segment must be at least 2 steps")
    if args.warmup is not None and args.warmup < 1:
        p.error("--warmup must be at least 1 step")
    models = [(*MODELS[m][:4], MODELS[m][4] if args.warmup is None else args.warmup,
               MODELS[m][5] if args.segment is None else args.segment) for m in labels]
    results = anyio.run(paired, models, args.rounds, args.ranks)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 1 if any(r["failed"] for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
