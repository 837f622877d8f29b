"""The operator's Prometheus metrics (names from ARCHITECTURE.md), in one registry it owns."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class OperatorMetrics:
    """Built once at start and passed to whoever records; served on ``/metrics`` (port 8081)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.reconcile_total = Counter(
            "conveyor_reconcile_total",
            "LLMService reconciles by result (success, degraded, error)",
            ["result"],
            registry=self.registry,
        )
        self.reconcile_seconds = Histogram(
            "conveyor_reconcile_duration_seconds",
            "Time of one LLMService reconcile (all its children and the namespace gateway)",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=self.registry,
        )
        self.leader = Gauge(
            "conveyor_operator_leader",
            "1 while this replica holds the leader Lease and acts, 0 while it stands by",
            registry=self.registry,
        )
        self.llmservices = Gauge(
            "conveyor_operator_llmservices",
            "LLMServices this replica has reconciled and not seen deleted",
            registry=self.registry,
        )
