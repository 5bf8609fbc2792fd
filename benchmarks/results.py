"""The suite's measurements: per metric, each launcher's values, the runs that failed (with why)
and the runs measured on a machine that never got quiet; the medians, ranges and ratios of the
table (benchmarks/report.py)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Series:
    """Repeated measurements of one metric under one launcher."""

    values: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.values) if self.values else float("nan")

    @property
    def low(self) -> float:
        return min(self.values) if self.values else float("nan")

    @property
    def high(self) -> float:
        return max(self.values) if self.values else float("nan")


@dataclass
class Metric:
    """One measured quantity, per launcher (a row group of the table)."""

    bench: str
    name: str
    unit: str
    higher_is_better: bool = False
    series: dict[str, Series] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # launcher -> why each of its failed runs failed: counted and shown beside its measured runs
    failures: dict[str, list[str]] = field(default_factory=dict)
    # launcher -> its runs measured on a machine that never got quiet (benchmarks/settle.py)
    unsettled: dict[str, int] = field(default_factory=dict)

    def add(self, launcher: str, value: float) -> None:
        self.series.setdefault(launcher, Series()).values.append(value)

    def fail(self, launcher: str, why: str) -> None:
        self.series.setdefault(launcher, Series())  # a side whose every run failed still has its row
        self.failures.setdefault(launcher, []).append(why)

    def mark_unsettled(self, launcher: str) -> None:
        self.unsettled[launcher] = self.unsettled.get(launcher, 0) + 1

    def median(self, launcher: str) -> float:
        s = self.series.get(launcher)
        return s.median if s else float("nan")

    def ratio(self, launcher: str, other: str) -> float:
        a, b = self.median(launcher), self.median(other)
        return a / b if b and b == b and a == a else float("nan")


@dataclass
class Results:
    metrics: dict[str, Metric] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)

    def metric(self, key: str, bench: str, name: str, unit: str, higher_is_better: bool = False) -> Metric:
        if key not in self.metrics:
            self.metrics[key] = Metric(bench, name, unit, higher_is_better)
        return self.metrics[key]
