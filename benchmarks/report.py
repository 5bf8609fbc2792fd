"""The results table, the targets of the issue (met or missed), and the JSON dump."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from .common import DDPD, DDPD_COLD, SPAWN, TORCHRUN_NAME
from .context import Plan
from .paired_table import median_interval
from .results import Metric, Results

EN_DASH = "\u2013"
DASH = EN_DASH
ORDER = (DDPD, DDPD_COLD, TORCHRUN_NAME, SPAWN)


def fmt(value: float, unit: str) -> str:
    if value != value:  # nan
        return DASH
    if unit == "s":
        return f"{value:.3f}"
    if unit in ("%", "MiB", "ms"):
        return f"{value:.1f}"
    return f"{value:.2f}"


def fmt_ratio(value: float) -> str:
    return DASH if value != value or math.isinf(value) else f"{value:.2f}x"


METRIC_ORDER = ("launch", "e2e", "detect", "detect_failed", "throughput", "cost_idle_cpu", "cost_idle_rss",
                "cost_train_cpu", "cost_train_rss", "scale_start", "scale_cpu", "scale_cpu_status", "scale_p50",
                "scale_p99", "scale_rss", "scale_hb_age")


def ordered(results: Results) -> list[Metric]:
    keys = sorted(results.metrics, key=lambda k: METRIC_ORDER.index(k) if k in METRIC_ORDER else len(METRIC_ORDER))
    return [results.metrics[k] for k in keys]


def results_table(results: Results) -> Table:
    table = Table(title="ddpd vs torchrun vs mp.spawn (median of repetitions, alternating launchers)",
                  title_justify="left")
    for col, justify in (("benchmark", "left"), ("metric", "left"), ("unit", "left"), ("launcher", "left"),
                         ("median", "right"), ("min" + EN_DASH + "max", "right"), ("n", "right"),
                         ("failed", "right"), ("unsettled", "right"), ("÷ torchrun", "right"), ("÷ mp.spawn", "right")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    last_bench = None
    for metric in ordered(results):
        first = True
        for launcher in sorted(metric.series, key=lambda n: ORDER.index(n) if n in ORDER else 99):
            s = metric.series[launcher]
            compare = launcher.startswith(DDPD) and (TORCHRUN_NAME in metric.series or SPAWN in metric.series)
            table.add_row(
                metric.bench if metric.bench != last_bench else "",
                metric.name if first else "",
                metric.unit if first else "",
                launcher,
                fmt(s.median, metric.unit),
                f"{fmt(s.low, metric.unit)}{EN_DASH}{fmt(s.high, metric.unit)}" if len(s.values) > 1 else "",
                str(len(s.values)),
                str(len(metric.failures.get(launcher, []))) if metric.failures.get(launcher) else "",
                str(metric.unsettled[launcher]) if metric.unsettled.get(launcher) else "",
                fmt_ratio(metric.ratio(launcher, TORCHRUN_NAME)) if compare else "",
                fmt_ratio(metric.ratio(launcher, SPAWN)) if compare else "",
            )
            first = False
            last_bench = metric.bench
        table.add_section()
    return table


@dataclass
class Target:
    name: str
    measured: str
    met: bool | None  # None: not measured


def targets(results: Results) -> list[Target]:
    m = results.metrics

    def med(key: str, launcher: str = DDPD) -> float:
        metric: Metric | None = m.get(key)
        return metric.median(launcher) if metric else float("nan")

    def ratio(key: str, a: str, b: str) -> float:
        metric = m.get(key)
        return metric.ratio(a, b) if metric else float("nan")

    def check(value: float, ok: bool) -> bool | None:
        return None if value != value else ok

    out: list[Target] = []
    v = med("e2e")
    out.append(Target("classic job submit → SUCCEEDED (pool) median < 0.5 s", f"{fmt(v, 's')} s", check(v, v < 0.5)))
    r = ratio("e2e", TORCHRUN_NAME, DDPD)
    out.append(Target("classic job ≥ 10x faster than torchrun", f"{fmt_ratio(r)} faster", check(r, r >= 10)))
    v = med("launch")
    out.append(Target("launch with the pool < 0.15 s", f"{fmt(v, 's')} s", check(v, v < 0.15)))
    r = ratio("launch", DDPD_COLD, TORCHRUN_NAME)
    out.append(Target("launch, cold path, no slower than torchrun (ratio ≤ 1.0)", fmt_ratio(r), check(r, r <= 1.0)))
    v = med("detect")
    out.append(Target("detection: SIGKILL → failed, all processes gone, median < 0.2 s", f"{fmt(v, 's')} s",
                      check(v, v < 0.2)))
    r = ratio("throughput", DDPD, TORCHRUN_NAME)
    out.append(Target("throughput ≥ 0.98 of torchrun's", fmt_ratio(r), check(r, r >= 0.98)))
    for label in ("tiny", "4x1024"):  # benchmarks.loop: jobs back to back, the pool refilling behind them
        r = ratio(f"loop.b2b.{label}", DDPD, TORCHRUN_NAME)
        out.append(Target(f"back-to-back steps/s ({label}), pooled, ≥ 0.98 of torchrun's", fmt_ratio(r),
                          check(r, r >= 0.98)))
    for label in ("tiny", "4x1024"):  # benchmarks.paired: the same, trained in turns with torchrun's
        for side in (DDPD, "ddpd (task)"):
            out.extend(paired_target(m.get(f"paired.{label}.ratio"), label, side))
    v = med("hot_replace", "ddpd (hot)")
    out.append(Target("hot replacement: SIGKILL → every rank training again < 1 s", f"{fmt(v, 's')} s",
                      check(v, v < 1.0)))
    v = med("hot_replace_lost", "ddpd (hot)")
    out.append(Target("hot replacement: 0 steps lost", f"{fmt(v, 'steps')}", check(v, v == 0)))
    v = med("scale_start")
    out.append(Target("500 simulated workers: submit → all RUNNING < 5 s", f"{fmt(v, 's')} s", check(v, v < 5)))
    v = med("scale_cpu")
    out.append(Target("500 simulated workers: daemon < 10% of one core", f"{fmt(v, '%')} %", check(v, v < 10)))
    v2 = med("scale_cpu_status")
    out.append(Target("  … with status requests running too: < 25%", f"{fmt(v2, '%')} %", check(v2, v2 < 25)))
    v = med("scale_p99")
    out.append(Target("500 simulated workers: status p99 < 20 ms", f"{fmt(v, 'ms')} ms", check(v, v < 20)))
    return out


def paired_target(metric: Metric | None, label: str, side: str) -> list[Target]:
    """ddpd's per-round ratio to torchrun's in the paired benchmark: its median (the target), with
    the 95% interval of that median and a second torchrun's own ratio beside it (the method's spread)."""
    if metric is None or side not in metric.series:
        return []
    values = metric.series[side].values
    low, high = median_interval(values)
    r = metric.median(side)
    again = metric.median("torchrun (again)")
    batch = metric.median("torchrun (batch)")
    what = "pooled script job, back to back" if side == DDPD else "built-in mlp task"
    return [Target(f"paired steps/s ({label}), {what}, ≥ 0.98 of torchrun's",
                   f"{fmt_ratio(r)} [{low:.2f}{EN_DASH}{high:.2f}]; torchrun again {fmt_ratio(again)}, "
                   f"torchrun at SCHED_BATCH {fmt_ratio(batch)}", None if r != r else r >= 0.98)]


def targets_table(items: list[Target]) -> Table:
    table = Table(title="Targets (this run, this machine)", title_justify="left")
    table.add_column("target")
    table.add_column("measured", justify="right")
    table.add_column("", justify="center")
    for t in items:
        mark = "[green]met[/green]" if t.met else "[red]MISSED[/red]" if t.met is False else "[yellow]n/a[/yellow]"
        table.add_row(t.name, t.measured, mark)
    return table


def print_report(console: Console, results: Results) -> list[Target]:
    console.print()
    console.print(results_table(results))
    items = targets(results)
    console.print(targets_table(items))
    unsettled = sum(sum(metric.unsettled.values()) for metric in results.metrics.values())
    if unsettled:  # counted per metric: a run feeding two metrics counts twice
        console.print(f"[yellow]{unsettled} measurement(s) were taken on a machine that never got quiet "
                      "(the 'unsettled' column): not figures to publish[/yellow]")
    for metric in ordered(results):
        for launcher, whys in metric.failures.items():
            console.print(f"failed: {metric.bench} ({metric.name}), {launcher}: {len(whys)} run(s)", style="red",
                          markup=False)
            for why in whys:
                console.print(f"  {why}", style="red", markup=False)
    if results.errors:
        console.print("[red]errors:[/red]")
        for err in results.errors:
            console.print(f"  {err}", style="red", markup=False)  # may quote a log: no markup
    return items


def dump_json(path: Path, plan: Plan, results: Results, items: list[Target]) -> None:
    def metric_json(metric: Metric) -> dict[str, Any]:
        return {
            "bench": metric.bench, "name": metric.name, "unit": metric.unit,
            "series": {k: {"values": s.values, "median": s.median, "min": s.low, "max": s.high,
                           "failed": metric.failures.get(k, []), "unsettled": metric.unsettled.get(k, 0)}
                       for k, s in metric.series.items()},
            "ratio_vs_torchrun": {k: metric.ratio(k, TORCHRUN_NAME) for k in metric.series if k.startswith(DDPD)},
            "ratio_vs_mp_spawn": {k: metric.ratio(k, SPAWN) for k in metric.series if k.startswith(DDPD)},
        }

    data = {
        "plan": asdict(plan),
        "info": results.info,
        "metrics": {key: metric_json(metric) for key, metric in results.metrics.items()},
        "targets": [asdict(t) for t in items],
        "errors": results.errors,
    }
    path.write_text(json.dumps(data, indent=2, allow_nan=True) + "\n")
