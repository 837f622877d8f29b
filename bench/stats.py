"""The one percentile function of every benchmark."""

from __future__ import annotations

import math
from collections.abc import Iterable

PERCENTILES = (50, 95, 99)
"""The percentiles a latency is described by."""


def percentile(values: Iterable[float], p: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), or None for no values."""
    xs = sorted(values)
    if not xs:
        return None
    k = (len(xs) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def describe(prefix: str, values: list[float]) -> dict[str, float | None]:
    """``{prefix}_mean`` and ``{prefix}_p50/p95/p99`` of ``values`` (None for no values)."""
    out: dict[str, float | None] = {f"{prefix}_mean": sum(values) / len(values) if values else None}
    for p in PERCENTILES:
        out[f"{prefix}_p{p}"] = percentile(values, p)
    return out
