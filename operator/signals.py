"""Signals for the autoscaler from what replicas expose: ``/load`` and ``/metrics``.

TTFT p95 is taken over the last window only: the change in each replica's
TTFT histogram since the window's start, summed over replicas, then the
quantile interpolated inside its bucket as Prometheus' ``histogram_quantile``
does. Lifetime totals would let an hour of good latency hide a bad minute.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from prometheus_client.parser import text_string_to_metric_families

from conveyor.runtime.metrics_names import TIME_TO_FIRST_TOKEN

Buckets = dict[float, float]
"""Upper bound (``le``) -> cumulative count."""


def parse_histogram(text: str, name: str = TIME_TO_FIRST_TOKEN) -> Buckets:
    """The cumulative buckets of histogram ``name`` in Prometheus text, summed over label sets."""
    buckets: Buckets = {}
    for family in text_string_to_metric_families(text):
        if family.name != name:
            continue
        for sample in family.samples:
            if sample.name == f"{name}_bucket":
                le = float(sample.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + sample.value
    return buckets


def restarted(now: Buckets, before: Buckets) -> bool:
    """Whether the counts went down between two scrapes: a new process counts from 0."""
    return any(now.get(le, 0.0) < count for le, count in before.items())


def delta(now: Buckets, before: Buckets | None) -> Buckets:
    """Observations between two scrapes; a restarted replica (counts went down) counts from 0."""
    if not before or restarted(now, before):
        return dict(now)
    return {le: count - before.get(le, 0.0) for le, count in now.items()}


def merge(parts: Iterable[Buckets]) -> Buckets:
    total: Buckets = {}
    for part in parts:
        for le, count in part.items():
            total[le] = total.get(le, 0.0) + count
    return total


def quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """``histogram_quantile(q, ...)`` over cumulative buckets; None when nothing was observed."""
    if not buckets:
        return None
    bounds = sorted(buckets)
    total = buckets[bounds[-1]]
    if total <= 0:
        return None
    rank = q * total
    prev_bound, prev_count = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return prev_bound  # beyond the last finite bucket: its bound is all we know
            if count == prev_count:
                return bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = bound, count
    return bounds[-1]
