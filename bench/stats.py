"""Summaries of repetitions and the growth exponent of a cost in N."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence


def summary(values: Iterable[float | None]) -> dict[str, float] | None:
    """median, min and max of the repetitions that have a value; None if none has."""
    present = [float(v) for v in values if v is not None]
    if not present:
        return None
    return {"median": statistics.median(present), "min": min(present), "max": max(present),
            "count": float(len(present))}


def growth_exponent(sizes: Sequence[float], costs: Sequence[float]) -> float | None:
    """Slope of log(cost) against log(N), least squares: cost ~ N^k.

    k = 1 is linear, k = 2 quadratic.  Points with a zero or negative cost
    cannot be on a log axis and are left out; fewer than two points give None.
    """
    points = [(math.log(n), math.log(c)) for n, c in zip(sizes, costs, strict=True)
              if n > 0 and c > 0]
    if len(points) < 2:
        return None
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    if sxx == 0:
        return None
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / sxx
