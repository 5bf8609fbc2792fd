"""An optional Prometheus endpoint (off by default, loopback by default), text format written by hand.

Gauges are read from the scheduler at scrape time; durations and counters are folded in from the
daemon's event bus, so they count exactly what the journal records.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable, Iterable
from typing import Any

import anyio
import structlog
from anyio.abc import SocketAttribute, SocketStream
from anyio.streams.buffered import BufferedByteReceiveStream
from anyio.streams.stapled import MultiListener

from ..protocol import JobState, RankState
from ..protocol.control import EventView
from .bus import EventBus
from .scheduler import Scheduler

log = structlog.get_logger("ddpd")

LAUNCH_BUCKETS = (0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)
TEARDOWN_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
MAX_REQUEST = 8192
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.sum += value
        self.count += 1
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1

    def lines(self, name: str) -> Iterable[str]:
        for bound, count in zip(self.buckets, self.counts, strict=True):
            yield f'{name}_bucket{{le="{bound:g}"}} {count}'
        yield f'{name}_bucket{{le="+Inf"}} {self.count}'
        yield f"{name}_sum {self.sum:.6f}"
        yield f"{name}_count {self.count}"


def _labels(**kw: Any) -> str:
    inner = ",".join(f'{k}="{_escape(str(v))}"' for k, v in kw.items())
    return "{" + inner + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class Metrics:
    """What the endpoint serves; `consume` keeps the event-derived series up to date."""

    def __init__(self, scheduler: Scheduler, started: float, version: str) -> None:
        self.scheduler = scheduler
        self.started = started
        self.version = version
        self.launch = Histogram(LAUNCH_BUCKETS)
        self.teardown = Histogram(TEARDOWN_BUCKETS)
        self.finished: dict[str, int] = {}
        self.heartbeats_missed = 0
        self.restarts = 0
        self._starting: dict[tuple[str, int | None], float] = {}

    def observe(self, event: EventView) -> None:
        key = (event.job_id or "", event.attempt)
        match event.kind:
            case "job.state_changed":
                to = event.data.get("to")
                if to == JobState.STARTING.value:
                    self._starting[key] = event.ts
                elif to == JobState.RUNNING.value and key in self._starting:
                    self.launch.observe(max(0.0, event.ts - self._starting.pop(key)))
                elif to == JobState.RESTARTING.value:
                    self.restarts += 1
                if to != JobState.STARTING.value and to != JobState.RUNNING.value:
                    self._starting.pop(key, None)
            case "job.torn_down":
                seconds = event.data.get("seconds")
                if isinstance(seconds, int | float):
                    self.teardown.observe(float(seconds))
            case "job.finished":
                state = str(event.data.get("state"))
                self.finished[state] = self.finished.get(state, 0) + 1
            case "rank.heartbeat_missed":
                self.heartbeats_missed += 1

    async def consume(self, bus: EventBus) -> None:
        while True:  # a subscriber that fell behind is dropped by the bus: subscribe again
            async with bus.subscribe() as stream:
                async for event in stream:
                    self.observe(event)

    def render(self) -> str:
        sched = self.scheduler
        now = time.monotonic()
        out: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: Iterable[str]) -> None:
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")
            out.extend(samples)

        metric("ddpd_info", "gauge", "Daemon version.", [f"ddpd_info{_labels(version=self.version)} 1"])
        metric("ddpd_uptime_seconds", "gauge", "Seconds since the daemon started.",
               [f"ddpd_uptime_seconds {now - self.started:.3f}"])
        by_state = {s.value: n for s, n in sched.state_counts().items()}
        metric("ddpd_jobs", "gauge", "Jobs known to the daemon, by state.",
               [f"ddpd_jobs{_labels(state=s)} {n}" for s, n in by_state.items()])
        metric("ddpd_queue_depth", "gauge", "Jobs waiting in the queue.",
               [f"ddpd_queue_depth {by_state[JobState.QUEUED.value]}"])
        live = [j for j in sched.unended.values() if j.id in sched.running]
        ranks = dict.fromkeys((s.value for s in RankState), 0)
        ages: list[str] = []
        steps: list[str] = []
        for job in live:
            for r in job.ranks:
                ranks[r.state.value] += 1
                if r.state is not RankState.EXITED and r.last_frame is not None:
                    lbl = _labels(job_id=job.id, attempt=r.attempt, rank=r.rank)
                    ages.append(f"ddpd_rank_heartbeat_age_seconds{lbl} {now - r.last_frame:.3f}")
                    steps.append(f"ddpd_rank_step{lbl} {r.step}")
        metric("ddpd_ranks", "gauge", "Ranks of running jobs, by state.",
               [f"ddpd_ranks{_labels(state=s)} {n}" for s, n in ranks.items()])
        metric("ddpd_rank_heartbeat_age_seconds", "gauge", "Seconds since the last frame of each live rank.", ages)
        metric("ddpd_rank_step", "gauge", "Last step each live rank reported.", steps)
        res = sched.resources
        metric("ddpd_cpu_slots", "gauge", "CPU slots, total and free.",
               [f'ddpd_cpu_slots{{kind="total"}} {res.total_cpu}', f'ddpd_cpu_slots{{kind="free"}} {res.free_cpu}'])
        metric("ddpd_gpus", "gauge", "GPUs, total and free.",
               [f'ddpd_gpus{{kind="total"}} {res.total_gpus}', f'ddpd_gpus{{kind="free"}} {len(res.free_gpus)}'])
        metric("ddpd_launch_seconds", "histogram", "From an attempt's start to all its ranks joined.",
               self.launch.lines("ddpd_launch_seconds"))
        metric("ddpd_teardown_seconds", "histogram", "Duration of an attempt's teardown.",
               self.teardown.lines("ddpd_teardown_seconds"))
        metric("ddpd_jobs_finished_total", "counter", "Jobs that reached a final state since the daemon started.",
               [f"ddpd_jobs_finished_total{_labels(state=s)} {n}" for s, n in sorted(self.finished.items())])
        metric("ddpd_job_restarts_total", "counter", "Attempts restarted after a failure.",
               [f"ddpd_job_restarts_total {self.restarts}"])
        metric("ddpd_heartbeats_missed_total", "counter", "rank.heartbeat_missed warnings.",
               [f"ddpd_heartbeats_missed_total {self.heartbeats_missed}"])
        return "\n".join(out) + "\n"


class MetricsServer:
    """A minimal HTTP/1.0 server: GET /metrics, one request per connection."""

    def __init__(self, render: Callable[[], str], token: str | None) -> None:
        self.render = render
        self.token = token

    @staticmethod
    async def listen(host: str, port: int) -> MultiListener[SocketStream]:
        """Bound before the daemon reports ready, so a taken port is an error at start."""
        listener = await anyio.create_tcp_listener(local_host=host, local_port=port)
        ports = sorted({sub.extra(SocketAttribute.local_port) for sub in listener.listeners})
        log.info("metrics.listening", host=host, port=ports[0] if ports else None)
        return listener

    async def serve(self, listener: MultiListener[SocketStream]) -> None:
        async with listener:
            await listener.serve(self._handle)

    async def _handle(self, stream: SocketStream) -> None:
        async with stream:
            try:
                with anyio.fail_after(10):
                    head = await BufferedByteReceiveStream(stream).receive_until(b"\r\n\r\n", MAX_REQUEST)
                    status, body = self._answer(head)
                    payload = body.encode()
                    ctype = CONTENT_TYPE if status.startswith("200") else "text/plain; charset=utf-8"
                    await stream.send(
                        f"HTTP/1.0 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(payload)}\r\n"
                        f"Connection: close\r\n\r\n".encode() + payload)
            except (TimeoutError, anyio.DelimiterNotFound, anyio.IncompleteRead, anyio.EndOfStream,
                    anyio.BrokenResourceError, OSError):
                return

    def _answer(self, head: bytes) -> tuple[str, str]:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split()
        if len(parts) != 3 or parts[0] != "GET":
            return "405 Method Not Allowed", "only GET /metrics\n"
        if self.token is not None:
            headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
            given = headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
                return "401 Unauthorized", "a bearer token is required\n"
        if parts[1].split("?")[0] != "/metrics":
            return "404 Not Found", "try /metrics\n"
        return "200 OK", self.render()
