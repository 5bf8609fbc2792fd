"""Each job's training curve as the daemon keeps it: fed from the ranks' progress, stored in the journal.

`CurveStore.observe` listens on the event bus (it is called as each event is published, so a reply
that follows an event sees its effect): a rank's `rank.progress` and `rank.result` events feed the
job's `JobFeed` (see `downsample`, which bounds each curve and keeps hostile values out). The
events are the ones the ranks' frames already make (within each rank's frame budget, and at most
five progress events a second per rank), so a flooding job costs nothing more here.

`run` writes the curves that changed to the journal, all in one transaction and off the event loop,
every `FLUSH_INTERVAL` seconds, at once when a job ends, and a last time when the daemon stops. An
ended job's curve is then dropped from memory and read back from the journal when asked. A job that
goes on under a new daemon (requeued at a restart) continues the curve the earlier one stored: the
stored curve is read before the first write or read, and the new points are appended to it. The
journal removes a job's curve with the job (`rm`, retention).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import anyio
import msgspec
import structlog

from ...protocol.control import CurvePoint, CurveResult, EventView
from .downsample import Bucket, Curve, CurveState, JobFeed
from .journal import Journal
from .records import Job

log = structlog.get_logger("ddpd")

FLUSH_INTERVAL = 5.0  # seconds between two writes of the curves that changed
RETRY_INTERVAL = 30.0  # after a write that failed


@dataclass(eq=False)
class _Entry:
    feed: JobFeed = field(default_factory=JobFeed)
    loaded: bool = False  # the curve an earlier daemon stored has been read and this one appended to it


def decode_state(data: str | None, job_id: str) -> CurveState | None:
    if data is None:
        return None
    try:
        return msgspec.json.decode(data, type=CurveState)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        log.warning("curve.unreadable", job_id=job_id, error=str(exc))
        return None


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


class CurveStore:
    def __init__(self, journal: Journal, flush_interval: float = FLUSH_INTERVAL) -> None:
        self.journal = journal
        self.flush_interval = flush_interval
        self.entries: dict[str, _Entry] = {}  # jobs that reported progress and were not yet written after their end
        self._dirty: set[str] = set()
        self._ended: set[str] = set()
        self._wake = anyio.Event()
        self._lock = anyio.Lock()  # one flush (or load) at a time

    # -- fed from the bus ------------------------------------------------------------------------

    def observe(self, event: EventView) -> None:
        job_id = event.job_id
        match event.kind:
            case "rank.progress" | "rank.result" if job_id is not None:
                step = event.data.get("step", event.data.get("steps"))
                if not isinstance(step, int) or isinstance(step, bool) or event.rank is None:
                    return
                entry = self.entries.setdefault(job_id, _Entry())
                if entry.feed.report(event.ts, event.attempt or 0, event.rank, step, _number(event.data.get("loss")),
                                     final=event.kind == "rank.result"):
                    self._dirty.add(job_id)
            case "job.finished" if job_id is not None and job_id in self.entries:
                self.entries[job_id].feed.finish()
                self._dirty.add(job_id)
                self._ended.add(job_id)
                self._wake.set()
            case "job.removed" | "job.pruned":
                gone = event.data.get("removed", event.data.get("pruned"))
                if isinstance(gone, str):
                    self.entries.pop(gone, None)
                    self._dirty.discard(gone)
                    self._ended.discard(gone)

    def latest(self, job_id: str) -> Bucket | None:
        """The newest point of a job's curve held in memory (running jobs; the one still waiting for the
        other ranks included), for the metrics."""
        entry = self.entries.get(job_id)
        return entry.feed.latest() if entry is not None else None

    # -- reads -----------------------------------------------------------------------------------

    async def curve(self, job_id: str) -> Curve | None:
        """A job's curve: the one in memory (with what an earlier daemon stored before it), else the stored one."""
        entry = self.entries.get(job_id)
        if entry is not None:
            if not entry.loaded:  # once only: a job that is watched is not held up by every flush
                async with self._lock:
                    await self._load(job_id, entry)
            return entry.feed.curve
        state = decode_state(await self.journal.load_curve(job_id), job_id)
        return None if state is None else Curve(state)

    async def _load(self, job_id: str, entry: _Entry) -> None:
        if entry.loaded:
            return
        stored = decode_state(await self.journal.load_curve(job_id), job_id)
        if stored is not None and stored.buckets:
            base = Curve(stored)
            base.extend(entry.feed.curve)  # what this daemon recorded meanwhile (no await since the read)
            entry.feed.curve = base
        entry.loaded = True

    # -- writes ----------------------------------------------------------------------------------

    async def flush(self) -> None:
        """Write every curve that changed (one transaction), then forget the ended jobs' ones."""
        async with self._lock:
            ids = list(self._dirty)
            for job_id in ids:
                if (entry := self.entries.get(job_id)) is not None:
                    await self._load(job_id, entry)
            batch = {job_id: msgspec.json.encode(e.feed.curve.state).decode()
                     for job_id in ids if (e := self.entries.get(job_id)) is not None}
            self._dirty.difference_update(ids)
            if batch:
                await self.journal.save_curves(batch)  # never raises: a failed write is logged by the journal
            for job_id in self._ended.intersection(ids):
                if job_id not in self._dirty:
                    self.entries.pop(job_id, None)
                    self._ended.discard(job_id)

    async def run(self) -> None:
        """Write changed curves every flush interval and when a job ends; a last time when cancelled."""
        try:
            while True:
                with anyio.move_on_after(self.flush_interval):
                    await self._wake.wait()
                self._wake = anyio.Event()
                try:
                    await self.flush()
                except Exception as exc:  # a read before the write failed (locked, disk gone): later
                    log.error("curve.write_failed", error=repr(exc))
                    with anyio.move_on_after(RETRY_INTERVAL):
                        await self._wake.wait()
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(30):
                try:
                    await self.flush()
                except Exception as exc:
                    log.error("curve.write_failed", error=repr(exc))


def curve_result(job: Job, curve: Curve | None) -> CurveResult:
    """The reply to `curve`: the job's points, oldest first (none yet: an empty list)."""
    state = curve.state if curve is not None else CurveState()
    return CurveResult(
        job_id=job.id, state=job.state.value, steps=job.spec.steps if job.spec.script is None else None,
        points=[CurvePoint(time=b.t, step=b.step, loss=b.loss, steps_per_second=b.rate()) for b in state.buckets],
        stride=state.stride, backwards=state.backwards, nonfinite=state.nonfinite)
