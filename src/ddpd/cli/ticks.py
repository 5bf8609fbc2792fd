"""Axis ticks for the loss charts (the terminal plot and the web view's SVG), with labels that tell
them apart.

`labels` gives each value as many significant digits as the set needs for every distinct value to
read differently: a loss from 1.0037 to 1.0051 reads 1.0037, 1.0044, 1.0051, never 1, 1, 1.01 (a fixed
three digits drew exactly that). `nice` picks round values (1, 2 or 5 times a power of ten apart)
inside a range, for an axis with grid lines. Pure functions, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

MIN_DIGITS, MAX_DIGITS = 3, 17  # 17 significant digits tell any two doubles apart


def labels(values: Sequence[float]) -> list[str]:
    """`values` as text, with the fewest significant digits (at least three) that keep distinct
    values distinct; equal values get equal labels."""
    wanted = len(set(values))
    out = [_fmt(v, MIN_DIGITS) for v in values]
    for digits in range(MIN_DIGITS, MAX_DIGITS + 1):
        out = [_fmt(v, digits) for v in values]
        if len(set(out)) == wanted:
            break
    return out


def _fmt(value: float, digits: int) -> str:
    return f"{value + 0.0:.{digits}g}"  # + 0.0: -0.0 reads 0


def nice(low: float, high: float, count: int = 5, whole: bool = False) -> list[float]:
    """Round values in [low, high], about `count` of them (at least two when the range allows);
    `whole`: integers only (steps). [low] when the range is empty."""
    if not (math.isfinite(low) and math.isfinite(high)) or high <= low:
        return [low]
    step = _nice_step((high - low) / max(1, count - 1))
    if whole:
        step = max(1.0, round(step))
    first = math.ceil(low / step - 1e-9)
    ticks = []
    for k in range(first, first + 4 * count):  # bounded: a nice step puts at most ~2.5 x count inside
        value = k * step
        if value > high + step * 1e-9:
            break
        ticks.append(float(round(value)) if whole else float(f"{value:.15g}"))  # 0.30000000000000004: 0.3
    return ticks if len(ticks) >= 2 else [low, high]


def _nice_step(raw: float) -> float:
    """The 1, 2 or 5 times a power of ten nearest `raw` (Heckbert's rounding)."""
    power = 10.0 ** math.floor(math.log10(raw))
    fraction = raw / power
    if fraction < 1.5:
        return power
    if fraction < 3:
        return 2 * power
    if fraction < 7:
        return 5 * power
    return 10 * power
