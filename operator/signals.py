"""Signals for the autoscaler from what replicas expose: ``/load`` and ``/metrics``.

TTFT p95 is taken over the last window only: the change in each replica's
TTFT histogram since the window's start, summed over replicas, then the
quantile interpolated inside its bucket as Prometheus' ``histogram_quantile``
does. Lifetime totals would let an hour of good latency hide a bad minute.

Demand and capacity come from counters the same way: each replica's finished requests and
tokens (prompt + generated) at each scrape, the service's backlog (running, waiting, held at
the gateways), and the requests the gateways turned away (429, 503: demand no replica took).
Over a window, arrivals = what finished + what was turned away + how much the backlog grew; a
replica that had a queue at every scrape of the panic window was saturated, so what it
finished is its capacity.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from prometheus_client.parser import text_string_to_metric_families

from conveyor.operator.autoscaler_model import Demand, Rates
from conveyor.runtime.metrics_names import (
    GENERATION_TOKENS,
    PROMPT_TOKENS,
    REQUEST_SUCCESS,
    TIME_TO_FIRST_TOKEN,
)

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


# ---- demand and capacity -----------------------------------------------------------------


@dataclass(frozen=True)
class Counters:
    """One replica at one scrape: its cumulative counters and whether it had a queue."""

    time: float
    requests: float
    """Finished requests (``conveyor_request_success_total``, all finish reasons)."""
    tokens: float
    """Prompt + generated tokens processed."""
    queued: bool
    """Requests were waiting on it (so it was not short of work)."""


@dataclass(frozen=True)
class Backlog:
    """The service at one scrape: requests running or waiting on ready replicas, or held."""

    time: float
    requests: int


REJECTED_CODES = frozenset({"429", "503"})
"""Gateway answers that mean a request came and no replica took it (queues full, none ready)."""


def parse_counters(
    text: str,
    requests: str = REQUEST_SUCCESS,
    prompt_tokens: str = PROMPT_TOKENS,
    generation_tokens: str = GENERATION_TOKENS,
) -> tuple[float, float] | None:
    """(finished requests, prompt + generated tokens) in a runtime's Prometheus text, summed
    over label sets; None when it has no request counter (not yet). The names are Conveyor's
    unless an engine's own are given (``conveyor.contracts.engine_load.EngineMetrics``)."""
    totals = {requests: 0.0, prompt_tokens: 0.0, generation_tokens: 0.0}
    found = False
    for family in text_string_to_metric_families(text):
        # declared is enough: a replica that finished nothing yet has no labelled sample
        found = found or family.name in (requests, requests.removesuffix("_total"))
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    if not found:
        return None
    return totals[requests], totals[prompt_tokens] + totals[generation_tokens]


class _Scrape(Protocol):
    @property
    def time(self) -> float: ...


ScrapeT = TypeVar("ScrapeT", bound=_Scrape)


def baseline(series: Sequence[ScrapeT], start: float) -> ScrapeT | None:
    """The last scrape at or before ``start``, else the oldest (a young replica); None when
    there is no earlier scrape than the last."""
    if len(series) < 2:
        return None
    base = series[0]
    for c in itertools.islice(series, len(series) - 1):
        if c.time <= start:
            base = c
    return base


def throughput(series: Sequence[Counters], start: float) -> Rates | None:
    """What one replica finished per second since ``start``; None without two scrapes."""
    base = baseline(series, start)
    if base is None or series[-1].time <= base.time:
        return None
    span = series[-1].time - base.time
    return Rates(
        (series[-1].requests - base.requests) / span, (series[-1].tokens - base.tokens) / span
    )


def _arrivals(
    replicas: Mapping[str, Sequence[Counters]],
    rejected: Mapping[str, Sequence[Counters]],
    backlog: Sequence[Backlog],
    start: float,
) -> tuple[Rates, float] | None:
    """(arrivals, backlog growth) per second since ``start``: what every replica finished in
    that span (a younger replica: since its first scrape), what the gateways turned away, and
    what the backlog grew by."""
    base = baseline(backlog, start)
    if base is None:
        return None
    span = backlog[-1].time - base.time
    if span <= 0:
        return None
    requests = tokens = 0.0
    for series in replicas.values():
        first = baseline(series, base.time)
        if first is not None:
            requests += series[-1].requests - first.requests
            tokens += series[-1].tokens - first.tokens
    turned_away = 0.0
    for series in rejected.values():
        first = baseline(series, base.time)
        if first is not None:
            turned_away += series[-1].requests - first.requests
    grew = backlog[-1].requests - base.requests
    arrived = max(0.0, requests + turned_away + grew)
    per_request = tokens / requests if requests > 0 else 0.0
    return Rates(arrived / span, arrived * per_request / span), grew / span


def _queued_since(series: Sequence[Counters], start: float) -> Rates | None:
    """Throughput since the first of the scrapes (after ``start``) that all had a queue up to
    the last, or over the last interval if only the last had one (a lower bound: the queue
    began within it); None when the last had none."""
    last = series[-1]
    if not last.queued:
        return None
    first = series[-2]
    for c in reversed(series):
        if not c.queued or c.time < start:
            break
        first = c if c is not last else first
    span = last.time - first.time
    if span <= 0:
        return None
    return Rates((last.requests - first.requests) / span, (last.tokens - first.tokens) / span)


def _mean(rates: list[Rates]) -> Rates | None:
    if not rates:
        return None
    return Rates(
        sum(r.requests for r in rates) / len(rates), sum(r.tokens for r in rates) / len(rates)
    )


def estimate_demand(
    replicas: Mapping[str, Sequence[Counters]],
    backlog: Sequence[Backlog],
    *,
    now: float,
    window: float,
    panic_window: float,
    rejected: Mapping[str, Sequence[Counters]] | None = None,
) -> Demand | None:
    """Arrivals over ``window``, ``panic_window`` and its last half, and what saturated replicas
    did.

    ``replicas`` holds each replica's scrapes, oldest first (those of the last window at
    least; a replica gone within the window stays, so that what it finished counts);
    ``backlog`` the service's; ``rejected`` each gateway's count of requests it turned away
    (in ``Counters.requests``). None until the backlog has two scrapes. Tokens of
    arrivals are requests times the tokens per finished request of the same window.
    """
    stable = _arrivals(replicas, rejected or {}, backlog, now - window)
    panic = _arrivals(replicas, rejected or {}, backlog, now - panic_window)
    if stable is None or panic is None:
        return None
    recent = _arrivals(replicas, rejected or {}, backlog, now - panic_window / 2)
    saturated, busy = [], []
    for series in replicas.values():
        rate, base = throughput(series, now - panic_window), baseline(series, now - panic_window)
        if rate is None or base is None or series[-1].time < now:
            continue  # too young, or gone (what it finished still counts as arrivals)
        covered = base.time <= now - panic_window / 2
        if covered and all(c.queued for c in series if c.time >= base.time):
            saturated.append(rate)
        queued_since = _queued_since(series, base.time)
        if queued_since is not None:
            busy.append(queued_since)
    return Demand(
        arrivals=stable[0],
        arrivals_panic=panic[0],
        backlog_growth=panic[1],
        saturated=_mean(saturated),
        busy=_mean(busy),
        arrivals_recent=None if recent is None else recent[0],
        recent_growth=0.0 if recent is None else recent[1],
    )
