"""The paired benchmark's figures (benchmarks/paired.py): per-round ratios, their median with a
distribution-free 95% interval, and the table that names what each side ran with.

Every side is compared with both references, torchrun as started (SCHED_OTHER) and torchrun under
``chrt -b 0`` (torchrun and its ranks at SCHED_BATCH, the policy ddpd gives CPU ranks), so the
table separates what the launcher does from what the scheduling policy does. The table says the
cores, the ranks per side and each side's policy as its rank 0 reported it; a side that failed is a
row with its reason, and its ratios cover the rounds before it failed.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

REFERENCES = ("torchrun", "torchrun (batch)")
FORKED, COLD = "ddpd (forked)", "ddpd (cold)"  # the same script on forked ranks, and on fresh interpreters


def median_interval(values: Sequence[float]) -> tuple[float, float]:
    """A distribution-free interval holding the median with at least 95% confidence: the k-th
    smallest and k-th largest value, k the largest with P(Binomial(n, 1/2) < k) <= 0.025."""
    n = len(values)
    ordered = sorted(values)
    k, below = 0, 0.0
    while k < n and below + math.comb(n, k) / 2**n <= 0.025:
        below += math.comb(n, k) / 2**n
        k += 1
    if k == 0:  # too few rounds for 95%: the whole range
        return ordered[0], ordered[-1]
    return ordered[k - 1], ordered[n - k]


def ratio_summary(mine: Sequence[float], reference: Sequence[float]) -> dict[str, Any] | None:
    """The per-round ratios of `mine` over `reference` (the rounds both measured) and their median
    with its 95% interval; None when they share no round."""
    ratios = [a / b for a, b in zip(mine, reference, strict=False)]  # a failed side stops early
    if not ratios:
        return None
    low, high = median_interval(ratios)
    return {"values": ratios, "median": statistics.median(ratios), "low95": low, "high95": high}


def summarise(model: str, rates: Mapping[str, list[float]], policies: Mapping[str, str],
              failed: Mapping[str, str], ranks: int, cores: int, settled: str = "") -> dict[str, Any]:
    """Each side's segment rates, policy and failure, and its ratios to each reference torchrun.
    ``ratios``/``ratio`` are over torchrun (as before); ``vs`` holds both references."""
    out: dict[str, Any] = {"model": model, "ranks": ranks, "cores": cores, "settled": settled, "rates": dict(rates),
                           "policies": dict(policies), "failed": dict(failed), "ratios": {}, "ratio": {}, "vs": {}}
    for reference in REFERENCES:
        if reference not in rates:
            continue
        table = out["vs"].setdefault(reference, {})
        for name in rates:
            if name != reference and (summary := ratio_summary(rates[name], rates[reference])) is not None:
                table[name] = summary
    if FORKED in rates and COLD in rates:  # the fork server's ranks against fresh interpreters
        out["forked_vs_cold"] = ratio_summary(rates[FORKED], rates[COLD])
    for name, summary in out["vs"].get(REFERENCES[0], {}).items():
        out["ratios"][name] = summary["values"]
        out["ratio"][name] = {k: summary[k] for k in ("median", "low95", "high95")}
    return out


def _ratio_cell(summary: dict[str, Any] | None) -> str:
    if summary is None:
        return "-"
    return f"{summary['median']:.3f}x [{summary['low95']:.3f}-{summary['high95']:.3f}] n={len(summary['values'])}"


def describe(result: dict[str, Any]) -> str:
    """The table: one row per side (policy, median steps/s, ratio to each torchrun with its 95%
    interval and rounds), under a line naming the cores and ranks."""
    rounds = max((len(r) for r in result["rates"].values()), default=0)
    spare = result["cores"] - result["ranks"]
    cores = (f"{result['cores']} cores, {result['ranks']} rank(s) per side "
             f"({'every core busy while a side runs' if spare <= 0 else f'{spare} core(s) spare'})")
    head = [f"paired, {result['model']}: {cores}; {rounds} rounds; before the rounds "
            f"{result.get('settled') or 'no settle'}; median segment steps/s and per-round ratios "
            f"(median [95% interval] n=rounds)"]
    columns = ("side", "policy", "steps/s", *(f"÷ {r}" for r in REFERENCES))
    rows = [columns]
    for name, rates in result["rates"].items():
        cells = [name, result["policies"].get(name, "?"),
                 f"{statistics.median(rates):.1f}" if rates else "-"]
        cells += ["" if name == ref else _ratio_cell(result["vs"].get(ref, {}).get(name)) for ref in REFERENCES]
        rows.append(tuple(cells))
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    lines = head + ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
                    for row in rows]
    policy = result["vs"].get(REFERENCES[0], {}).get(REFERENCES[1])
    if policy is not None:  # the same launcher, the policy alone
        lines.append(f"  the policy alone here (torchrun at SCHED_BATCH over torchrun): {_ratio_cell(policy)}")
    if result.get("forked_vs_cold") is not None:
        lines.append(f"  forked ranks over cold ranks (the same script, per round): "
                     f"{_ratio_cell(result['forked_vs_cold'])}")
    lines += [f"  FAILED {name}: {why}" for name, why in result["failed"].items()]
    return "\n".join(lines)
