"""An optional Prometheus endpoint (off by default, loopback by default), exposed through prometheus-client.

The series live in a private `CollectorRegistry`: a custom collector (`DaemonCollector`) reads one
overview of the daemon's jobs (`queue.facade.Jobs.overview`), its devices, the curves and the last
resource sample at scrape time; the durations are prometheus-client Histograms and the counters are
folded in from the daemon's event bus, so they count exactly what the journal records;
`ProcessCollector` and `PlatformCollector` describe the daemon's own process. Per scrape, the ranks'
memory and CPU time and the GPUs (NVML, where present) are read in a worker thread within a bounded
time (`samplers`); the exposition itself is `generate_latest`, on the event loop, so the collector
reads the jobs between two of their changes. Label values are escaped by the library.

Series: ddpd_info, ddpd_uptime_seconds, ddpd_jobs{state}, ddpd_queue_depth, ddpd_ranks{state},
ddpd_rank_heartbeat_age_seconds / ddpd_rank_step / ddpd_rank_resident_memory_bytes /
ddpd_rank_cpu_seconds_total {job_id,attempt,rank}, ddpd_job_step / ddpd_job_loss /
ddpd_job_steps_per_second {job_id}, ddpd_cpu_slots{kind}, ddpd_gpus{kind}, ddpd_gpu_memory_used_bytes /
ddpd_gpu_memory_total_bytes / ddpd_gpu_utilization_percent {gpu,uuid}, ddpd_gpu_job{gpu,job_id},
ddpd_gpu_quarantined{gpu,uuid,reason},
ddpd_launch_seconds, ddpd_teardown_seconds, ddpd_jobs_finished_total{state}, ddpd_job_restarts_total,
ddpd_heartbeats_missed_total, ddpd_metrics_ranks_unsampled, process_*, python_info.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import anyio
import anyio.to_thread
from prometheus_client import CollectorRegistry, Histogram, PlatformCollector, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ...protocol import JobState, RankState
from ...protocol.control import EventView
from ..gpu.gpuview import Devices
from ..queue.facade import Overview
from ..store.bus import EventBus
from ..store.curves import CurveStore
from .metrics_http import MetricsServer
from .samplers import RankTarget, Usage, sample

__all__ = ["Metrics", "MetricsServer"]

LAUNCH_BUCKETS = (0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)
TEARDOWN_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
SAMPLE_TIMEOUT = 5.0  # seconds a scrape waits for the resource sample; past it, the scrape goes without


class Metrics:
    """What the endpoint serves; `consume` keeps the event-derived series up to date."""

    def __init__(self, overview: Callable[[], Overview], devices: Devices, started: float, version: str,
                 curves: CurveStore | None = None, *, gpus: bool = True) -> None:
        self.overview = overview  # the jobs now (queue.facade.Jobs.overview)
        self.devices = devices  # the daemon's GPUs: who holds them, draining, quarantined
        self.started = started
        self.version = version
        self.curves = curves
        self.gpus = gpus  # read GPUs through NVML at scrape time
        self.registry = CollectorRegistry(auto_describe=True)
        self.launch = Histogram("ddpd_launch_seconds", "From an attempt's start to all its ranks joined.",
                                buckets=LAUNCH_BUCKETS, registry=self.registry)
        self.teardown = Histogram("ddpd_teardown_seconds", "Duration of an attempt's teardown.",
                                  buckets=TEARDOWN_BUCKETS, registry=self.registry)
        self.finished: dict[str, int] = {}
        self.heartbeats_missed = 0
        self.restarts = 0
        self._starting: dict[tuple[str, int | None], float] = {}
        self.collector = DaemonCollector(self)
        self.registry.register(self.collector)
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        self._limiter = anyio.CapacityLimiter(1)  # one resource sample at a time

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

    def targets(self) -> list[RankTarget]:
        """The live ranks of running jobs, with their pids."""
        return [RankTarget(job.id, r.attempt, r.rank, r.pid)
                for job in self.overview().running
                for r in job.ranks if r.pid is not None and r.state is not RankState.EXITED]

    async def render(self) -> bytes:
        """One scrape: the resource sample off the loop (bounded), then the exposition."""
        targets = self.targets()
        usage = Usage(skipped=len(targets))  # what the scrape shows if the sample does not come in time
        with anyio.move_on_after(SAMPLE_TIMEOUT):
            usage = await anyio.to_thread.run_sync(lambda: sample(targets, gpus=self.gpus),
                                                   limiter=self._limiter, abandon_on_cancel=True)
        self.collector.usage = usage  # no await from here to the end of the exposition
        return generate_latest(self.registry)


def _gauge(name: str, help_: str, labels: list[str] | None = None) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, help_, labels=labels)


class DaemonCollector(Collector):
    """The jobs', the curves' and the last sample's series, read when the registry is collected."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.usage = Usage()

    def describe(self) -> list[Metric]:
        return []  # names are not registered up front: the collector's series vary with the jobs

    def collect(self) -> Iterator[Metric]:
        m, now = self.metrics, time.monotonic()
        jobs_now = m.overview()  # one read of the jobs for the whole exposition
        info = _gauge("ddpd_info", "Daemon version.", ["version"])
        info.add_metric([m.version], 1)
        yield info
        yield GaugeMetricFamily("ddpd_uptime_seconds", "Seconds since the daemon started.", value=now - m.started)
        by_state = {s.value: n for s, n in jobs_now.states.items()}
        jobs = _gauge("ddpd_jobs", "Jobs known to the daemon, by state.", ["state"])
        for state, n in by_state.items():
            jobs.add_metric([state], n)
        yield jobs
        yield GaugeMetricFamily("ddpd_queue_depth", "Jobs waiting in the queue.",
                                value=by_state.get(JobState.QUEUED.value, 0))
        yield from self._ranks_and_jobs(jobs_now, now)
        cpu = _gauge("ddpd_cpu_slots", "CPU slots, total and free.", ["kind"])
        cpu.add_metric(["total"], jobs_now.cpu_slots)
        cpu.add_metric(["free"], jobs_now.free_cpu_slots)
        gpus = _gauge("ddpd_gpus", "GPUs, total and free.", ["kind"])
        gpus.add_metric(["total"], jobs_now.gpus)
        gpus.add_metric(["free"], jobs_now.free_gpus)
        yield from (cpu, gpus)
        yield from self._gpus(jobs_now)
        finished = CounterMetricFamily("ddpd_jobs_finished_total",
                                       "Jobs that reached a final state since the daemon started.", labels=["state"])
        for state, n in sorted(m.finished.items()):
            finished.add_metric([state], n)
        yield finished
        yield CounterMetricFamily("ddpd_job_restarts_total", "Attempts restarted after a failure.", value=m.restarts)
        yield CounterMetricFamily("ddpd_heartbeats_missed_total", "rank.heartbeat_missed warnings.",
                                  value=m.heartbeats_missed)
        yield GaugeMetricFamily("ddpd_metrics_ranks_unsampled",
                                "Live ranks whose memory and CPU the last scrape could not read in time.",
                                value=self.usage.skipped)

    def _ranks_and_jobs(self, jobs_now: Overview, now: float) -> Iterator[Metric]:
        m = self.metrics
        rank_labels = ["job_id", "attempt", "rank"]
        states = dict.fromkeys((s.value for s in RankState), 0)
        age = _gauge("ddpd_rank_heartbeat_age_seconds", "Seconds since the last frame of each live rank.", rank_labels)
        step = _gauge("ddpd_rank_step", "Last step each live rank reported.", rank_labels)
        job_step = _gauge("ddpd_job_step", "Highest step the job's ranks reported (running jobs).", ["job_id"])
        job_loss = _gauge("ddpd_job_loss", "The job's last loss on its curve (running jobs).", ["job_id"])
        job_rate = _gauge("ddpd_job_steps_per_second", "The job's steps per second at its curve's last point.",
                          ["job_id"])
        for job in jobs_now.running:
            for r in job.ranks:
                states[r.state.value] += 1
                if r.state is not RankState.EXITED and r.last_frame is not None:
                    labels = [job.id, str(r.attempt), str(r.rank)]
                    age.add_metric(labels, now - r.last_frame)
                    step.add_metric(labels, r.step)
            if job.ranks:
                job_step.add_metric([job.id], max(r.step for r in job.ranks))
            last = None if m.curves is None else m.curves.latest(job.id)
            if last is not None and last.loss is not None:
                job_loss.add_metric([job.id], last.loss)
            if last is not None and (rate := last.rate()) is not None:
                job_rate.add_metric([job.id], rate)
        ranks = _gauge("ddpd_ranks", "Ranks of running jobs, by state.", ["state"])
        for state, n in states.items():
            ranks.add_metric([state], n)
        rss = _gauge("ddpd_rank_resident_memory_bytes", "Resident memory of each live rank's process.", rank_labels)
        cpu = CounterMetricFamily("ddpd_rank_cpu_seconds_total", "CPU time (user and system) of each live rank's "
                                  "process.", labels=rank_labels)
        for used in self.usage.ranks:
            t = used.target
            labels = [t.job_id, str(t.attempt), str(t.rank)]
            rss.add_metric(labels, used.rss)
            cpu.add_metric(labels, used.cpu_seconds)
        yield from (ranks, age, step, rss, cpu, job_step, job_loss, job_rate)

    def _gpus(self, jobs_now: Overview) -> Iterator[Metric]:
        yield self._quarantined()
        if not self.usage.gpus:
            return  # no NVML (or no GPU): no GPU series
        labels = ["gpu", "uuid"]
        used = _gauge("ddpd_gpu_memory_used_bytes", "Memory in use on each GPU (NVML).", labels)
        total = _gauge("ddpd_gpu_memory_total_bytes", "Memory of each GPU (NVML).", labels)
        util = _gauge("ddpd_gpu_utilization_percent", "Each GPU's utilisation over the driver's last sample period.",
                      labels)
        holder = _gauge("ddpd_gpu_job", "1 for each GPU and each running job that holds it (or a share of it).",
                        [*labels, "job_id"])
        share = _gauge("ddpd_gpu_held_ratio", "The share of each GPU running jobs hold (0 to 1).", labels)
        draining = _gauge("ddpd_gpu_draining", "1 for each GPU and each ended job whose ranks may still hold it.",
                          [*labels, "job_id"])
        # GPUs are named as everywhere: the NVML index (index/migN for a MIG device) and the UUID; a
        # job holds the devices whose entries (UUIDs) its job.gpus lists
        res = self.metrics.devices
        mine = {d.entry for d in res.devices}
        held: dict[str, list[str]] = {}
        for job in jobs_now.running:
            for entry in dict.fromkeys(job.gpus):
                held.setdefault(entry, []).append(job.id)
        for gpu in self.usage.gpus:
            if gpu.entry not in mine:
                continue  # NVML lists it, the daemon does not schedule it
            key = [gpu.label, gpu.uuid]
            if gpu.memory_used is not None and gpu.memory_total is not None:
                used.add_metric(key, gpu.memory_used)
                total.add_metric(key, gpu.memory_total)
            if gpu.utilization is not None:
                util.add_metric(key, gpu.utilization)
            share.add_metric(key, res.held_share(gpu.entry))
            for job_id in held.get(gpu.entry, []):
                holder.add_metric([*key, job_id], 1)
            for job_id in (j for j, entries in res.draining.items() if gpu.entry in entries):
                draining.add_metric([*key, job_id], 1)
        yield from (used, total, util, holder, share, draining)

    def _quarantined(self) -> Metric:
        """Every quarantined device, from the daemon's resources (NVML may not answer for a GPU off the bus)."""
        gauge = _gauge("ddpd_gpu_quarantined", "1 for each GPU held out of service after a fault, until released.",
                       ["gpu", "uuid", "reason"])
        res = self.metrics.devices
        for gpu in res.devices:
            if gpu.entry in res.quarantined:
                gauge.add_metric([gpu.label, gpu.uuid, res.quarantined[gpu.entry]], 1)
        return gauge
