"""The gateway's Prometheus metrics (names and labels as ARCHITECTURE.md lists them).

Each :class:`GatewayMetrics` owns its own registry, so tests and several apps in one
process never share counters. With ``--workers`` above 1 every worker process writes its
series to files in ``$PROMETHEUS_MULTIPROC_DIR`` (prometheus_client's multiprocess mode)
and any worker's /metrics sums them all: counters and histograms add up, in-flight and
held requests are summed over live workers, a replica's load is the latest any worker saw.
"""

from __future__ import annotations

import contextlib
import os
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics import MetricWrapperBase

REQUESTS_TOTAL = "conveyor_gateway_requests_total"
REQUEST_DURATION = "conveyor_gateway_request_duration_seconds"
TIME_TO_FIRST_TOKEN = "conveyor_gateway_time_to_first_token_seconds"
RETRIES_TOTAL = "conveyor_gateway_retries_total"
EJECTIONS_TOTAL = "conveyor_gateway_ejections_total"
BACKEND_IN_FLIGHT = "conveyor_gateway_backend_in_flight"
BACKEND_LOAD = "conveyor_gateway_backend_load"
ROUTING_DECISIONS_TOTAL = "conveyor_gateway_routing_decisions_total"
PENDING_REQUESTS = "conveyor_gateway_pending_requests"

LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
)  # fmt: skip
"""Milliseconds for the gateway's own overhead up to minutes for long generations."""

LOAD_SIGNALS = ("running", "waiting", "kv_cache_usage")

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
"""Set (by ``conveyor gateway --workers N``) before the workers import prometheus_client."""


M = TypeVar("M", bound=MetricWrapperBase)


class Labelled(Generic[M]):
    """A metric whose labelled series are each looked up once: prometheus_client's
    ``labels()`` takes a lock and builds a tuple of strings on every call, several times per
    proxied request; here a request's series is one dict lookup."""

    def __init__(self, metric: M) -> None:
        self.metric = metric
        self._series: dict[tuple[str, ...], M] = {}

    def labels(self, *values: str) -> M:
        series = self._series.get(values)
        if series is None:
            series = self._series[values] = self.metric.labels(*values)
        return series

    def remove(self, *values: str) -> None:
        """Drop a series (KeyError where it was never written)."""
        self._series.pop(values, None)
        self.metric.remove(*values)


def multiprocess() -> bool:
    return bool(os.environ.get(MULTIPROC_ENV))


def _name(full: str, suffix: str = "") -> str:
    # prometheus_client appends _total to counters itself
    return full.removesuffix(suffix) if suffix else full


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Labelled(Counter(
            _name(REQUESTS_TOTAL, "_total"), "Requests by model, backend and status code.",
            ["model", "backend", "code"], registry=r,
        ))  # fmt: skip
        self.duration = Labelled(Histogram(
            REQUEST_DURATION, "Arrival at the gateway to last byte sent.", ["model"],
            buckets=LATENCY_BUCKETS, registry=r,
        ))  # fmt: skip
        self.ttft = Labelled(Histogram(
            TIME_TO_FIRST_TOKEN, "Arrival at the gateway to first token sent (streamed requests).",
            ["model"], buckets=LATENCY_BUCKETS, registry=r,
        ))  # fmt: skip
        self.retries = Labelled(Counter(
            _name(RETRIES_TOTAL, "_total"), "Attempts retried on another replica before the first byte.",
            ["model", "backend"], registry=r,
        ))  # fmt: skip
        self.ejections = Labelled(Counter(
            _name(EJECTIONS_TOTAL, "_total"), "Replicas taken out of routing after a failure.",
            ["model", "backend"], registry=r,
        ))  # fmt: skip
        self.in_flight = Labelled(Gauge(
            BACKEND_IN_FLIGHT, "The gateway's own in-flight requests per backend.",
            ["model", "backend"], registry=r, multiprocess_mode="livesum",
        ))  # fmt: skip
        self.load = Labelled(Gauge(
            BACKEND_LOAD, "Last /load seen per backend.", ["model", "backend", "signal"],
            registry=r, multiprocess_mode="livemostrecent",
        ))  # fmt: skip
        self.decisions = Labelled(Counter(
            _name(ROUTING_DECISIONS_TOTAL, "_total"), "Routing decisions by policy and reason.",
            ["model", "policy", "reason"], registry=r,
        ))  # fmt: skip
        self.pending = Labelled(Gauge(
            PENDING_REQUESTS,
            "Requests held at the gateway: their model has no ready replica, or (with "
            "--queue-at-gateway) no replica with room.",
            ["model"],
            registry=r, multiprocess_mode="livesum",
        ))  # fmt: skip

    def exposition(self) -> bytes:
        """The text /metrics answers: this registry's, or every worker's summed."""
        if not multiprocess():
            return generate_latest(self.registry)
        from prometheus_client import multiprocess as mp

        registry = CollectorRegistry()
        mp.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        return generate_latest(registry)

    @staticmethod
    def worker_exited() -> None:
        """A worker's live gauges stop counting once it is gone (multiprocess mode)."""
        if multiprocess():
            from prometheus_client import multiprocess as mp

            mp.mark_process_dead(os.getpid())  # type: ignore[no-untyped-call]

    def forget_backend(self, backend: str, models: set[str]) -> None:
        """Drop a removed replica's per-backend series so dashboards do not show ghosts."""
        for model in models:
            for gauge, extra in ((self.in_flight, ()), *((self.load, (s,)) for s in LOAD_SIGNALS)):
                with contextlib.suppress(KeyError):  # the series was never written
                    gauge.remove(model, backend, *extra)
