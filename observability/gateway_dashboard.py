"""The "Gateway" dashboard: how the namespace gateways spread requests over replicas, what
failed and was retried, which replicas were ejected, and the latency the gateway adds."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as dash

from conveyor.observability import names as n
from conveyor.observability.panels import (
    COUNT,
    PER_S,
    REQUESTS_PER_S,
    SECONDS,
    dashboard,
    events,
    matchers,
    panel,
    quantile,
    quantile_queries,
    query_variable,
    rate,
)

UID = "conveyor-gateway"
TITLE = "Conveyor / Gateway"

GATEWAY = matchers(n.NAMESPACE, n.MODEL, n.POD)
"""Series of the selected namespaces' gateway pods, for the selected models."""
RUNTIME = matchers(n.NAMESPACE, n.MODEL)
"""The replicas behind them (for the latency the gateway adds)."""


def variables() -> list[dash.QueryVariable]:
    return [
        query_variable(n.NAMESPACE, "Namespace", n.GW_REQUESTS, n.NAMESPACE),
        query_variable(n.MODEL, "Model", n.GW_REQUESTS, n.MODEL, after=matchers(n.NAMESPACE)),
        query_variable(
            n.POD, "Gateway pod", n.GW_REQUESTS, n.POD, after=matchers(n.NAMESPACE, n.MODEL)
        ),
    ]


def build() -> dash.Dashboard:
    board = dashboard(
        UID,
        TITLE,
        "Requests by replica and status, routing decisions, retries and ejections, in-flight "
        "requests per replica and the latency the gateway adds.",
        ["gateway"],
    )
    for variable in variables():
        board = board.with_variable(variable)
    gateway_load = (
        f'max by (backend, signal) ({n.GW_BACKEND_LOAD}{{{GATEWAY}, signal=~"running|waiting"}})'
    )
    return (
        board.with_row(dash.Row("Requests"))
        .with_panel(
            panel(
                "Requests by replica and status code",
                "Answers per replica (backend) and HTTP status; a request refused before any "
                "replica was tried (no replica, bad request) has an empty backend.",
                [(rate(n.GW_REQUESTS, GATEWAY, "backend, code"), "{{backend}} {{code}}")],
                unit=REQUESTS_PER_S,
                width=24,
            )
        )
        .with_panel(
            panel(
                "Routing decisions by policy and reason",
                "Why each request went where it went: prefix affinity, overflow to a less "
                "loaded replica, least load, round robin.",
                [(rate(n.GW_DECISIONS, GATEWAY, "policy, reason"), "{{policy}} {{reason}}")],
                unit=PER_S,
                stacked=True,
            )
        )
        .with_panel(
            panel(
                "In-flight requests per replica",
                "Requests this gateway has open on each replica.",
                [(f"sum by (backend) ({n.GW_IN_FLIGHT}{{{GATEWAY}}})", "{{backend}}")],
                unit=COUNT,
            )
        )
        .with_row(dash.Row("Failures"))
        .with_panel(
            panel(
                "Retries",
                "Attempts moved to another replica before the first byte, by the replica that failed.",
                [(events(n.GW_RETRIES, GATEWAY, "backend"), "{{backend}}")],
                unit=COUNT,
                width=8,
            )
        )
        .with_panel(
            panel(
                "Ejections",
                "Replicas taken out of routing after a failure (connection refused, timeouts, "
                "failed /load polls).",
                [(events(n.GW_EJECTIONS, GATEWAY, "backend"), "{{backend}}")],
                unit=COUNT,
                width=8,
            )
        )
        .with_panel(
            panel(
                "Requests held for a replica",
                "Requests waiting for a model with no ready replica (scale from zero).",
                [(f"sum by (model) ({n.GW_PENDING}{{{GATEWAY}}})", "{{model}}")],
                unit=COUNT,
                width=8,
            )
        )
        .with_row(dash.Row("Latency"))
        .with_panel(
            panel(
                "Request duration at the gateway",
                "Arrival at the gateway to the last byte sent, p50/p95/p99.",
                quantile_queries(n.GW_DURATION, GATEWAY, "model", "{{model}}"),
                unit=SECONDS,
                width=8,
            )
        )
        .with_panel(
            panel(
                "TTFT at the gateway and at the replicas",
                "Time to first token seen by clients at the gateway (streamed requests) and "
                "measured by the replicas, p50 and p95: the gap is the latency the gateway adds "
                "(routing, proxying, retries).",
                [
                    (quantile(0.5, n.GW_TTFT, GATEWAY, "model"), "{{model}} gateway p50"),
                    (quantile(0.5, n.TTFT, RUNTIME, "model"), "{{model}} replicas p50"),
                    (quantile(0.95, n.GW_TTFT, GATEWAY, "model"), "{{model}} gateway p95"),
                    (quantile(0.95, n.TTFT, RUNTIME, "model"), "{{model}} replicas p95"),
                ],
                unit=SECONDS,
                width=8,
            )
        )
        .with_panel(
            panel(
                "Replica load seen by the gateway",
                "The last /load each replica reported to the gateway: running and waiting requests.",
                [(gateway_load, "{{backend}} {{signal}}")],
                unit=COUNT,
                width=8,
            )
        )
    )
