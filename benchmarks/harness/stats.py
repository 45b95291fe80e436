"""Statistics of a benchmark's samples: percentiles, medians, fairness, ratios. NaN where a figure is undefined."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence

__all__ = ["fmt_ms", "jain_index", "median", "percentile", "ratio_of", "summarize"]


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between order statistics (numpy's default).

    Returns NaN for an empty input.

    >>> percentile([1, 2, 3, 4], 50)
    2.5
    >>> percentile([5.0], 99)
    5.0
    """
    data = sorted(float(v) for v in values)
    if not data:
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be within 0..100, got {q}")
    pos = (len(data) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def median(values: Iterable[float]) -> float:
    """The median, NaN for an empty input (``statistics.median`` raises there).

    >>> median([3, 1, 2])
    2
    >>> median([])
    nan
    """
    data = list(values)
    return statistics.median(data) if data else math.nan


def ratio_of(numerator: float | None, denominator: float | None) -> float:
    """``numerator / denominator``, NaN when either is missing or the denominator is 0 or NaN.

    >>> ratio_of(3, 2)
    1.5
    >>> ratio_of(1, 0)
    nan
    """
    if numerator is None or denominator is None or not denominator or math.isnan(denominator):
        return math.nan
    return numerator / denominator


def jain_index(values: Iterable[float]) -> float:
    """Jain's fairness index ``(sum x)^2 / (n * sum x^2)``: 1.0 when all equal, ``1/n`` when one gets everything.

    An all-zero input is perfectly fair (1.0); an empty one is NaN.

    >>> jain_index([3, 3, 3])
    1.0
    >>> round(jain_index([1, 0, 0, 0]), 2)
    0.25
    """
    xs = [float(v) for v in values]
    if not xs:
        return math.nan
    sq = sum(x * x for x in xs)
    if sq == 0:
        return 1.0
    return sum(xs) ** 2 / (len(xs) * sq)


def summarize(values: Sequence[float]) -> dict[str, float]:
    """count, mean, p50, p90, p99, max of a sample (NaN where undefined)."""
    n = len(values)
    return {
        "count": n,
        "mean": (sum(values) / n) if n else math.nan,
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "max": max(values) if n else math.nan,
    }


def fmt_ms(seconds: float | None, digits: int = 1) -> str:
    """Seconds as a millisecond string ('-' for NaN/None)."""
    if seconds is None or (isinstance(seconds, float) and math.isnan(seconds)):
        return "-"
    return f"{seconds * 1000:.{digits}f}"
