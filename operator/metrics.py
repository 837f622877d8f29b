"""The operator's Prometheus metrics (names from ARCHITECTURE.md), in one registry it owns."""

from __future__ import annotations

import contextlib

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
        per_service = ["namespace", "llmservice"]
        self.autoscaler_desired = Gauge(
            "conveyor_autoscaler_desired_replicas",
            "Replicas the autoscaler's last decision asked for",
            per_service,
            registry=self.registry,
        )
        self.autoscaler_ready = Gauge(
            "conveyor_autoscaler_ready_replicas",
            "Replicas that were ready and answered the autoscaler's last scrape",
            per_service,
            registry=self.registry,
        )
        self.autoscaler_min = Gauge(
            "conveyor_autoscaler_min_replicas",
            "spec.autoscaling.minReplicas",
            per_service,
            registry=self.registry,
        )
        self.autoscaler_max = Gauge(
            "conveyor_autoscaler_max_replicas",
            "spec.autoscaling.maxReplicas",
            per_service,
            registry=self.registry,
        )
        self.autoscaler_signal = Gauge(
            "conveyor_autoscaler_signal",
            "Last observed signal (queue_depth_per_replica, ttft_p95_seconds, kv_cache_usage) and "
            "estimate (demand_requests_per_second, demand_tokens_per_second, "
            "capacity_requests_per_second and capacity_tokens_per_second of one replica, "
            "utilization, replicas_needed, replica_start_seconds as learned; NaN while no "
            "capacity figure sizes the decision)",
            [*per_service, "signal"],
            registry=self.registry,
        )
        self.autoscaler_target = Gauge(
            "conveyor_autoscaler_target",
            "Target of each signal, from spec.autoscaling (utilization: targetUtilization)",
            [*per_service, "signal"],
            registry=self.registry,
        )
        self.autoscaler_decisions = Counter(
            "conveyor_autoscaler_decisions",
            "Autoscaler decisions by direction (up, down, none) and reason",
            [*per_service, "direction", "reason"],
            registry=self.registry,
        )

    def forget_llmservice(self, namespace: str, name: str) -> None:
        """Drop a deleted (or no longer autoscaled) LLMService's autoscaler series."""
        for gauge in (
            self.autoscaler_desired,
            self.autoscaler_ready,
            self.autoscaler_min,
            self.autoscaler_max,
        ):
            with contextlib.suppress(KeyError):  # never written
                gauge.remove(namespace, name)
        for family in (self.autoscaler_signal, self.autoscaler_target, self.autoscaler_decisions):
            for labels in list(family._metrics):  # no public lister of label sets
                if labels[:2] == (namespace, name):
                    family.remove(*labels)
