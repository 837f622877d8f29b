"""The "Autoscaler" dashboard: desired against ready replicas within their bounds, each
signal against its target, the decisions with their reasons, and the demand and capacity
estimates that size the replicas."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.builders import timeseries

from conveyor.observability import names as n
from conveyor.observability.panels import (
    COUNT,
    PER_S,
    RATIO,
    REQUESTS_PER_S,
    SECONDS,
    dashboard,
    events,
    matchers,
    panel,
    query_variable,
)

UID = "conveyor-autoscaler"
TITLE = "Conveyor / Autoscaler"

OPERATOR = matchers(n.NAMESPACE, n.LLMSERVICE)


def variables() -> list[dash.QueryVariable]:
    return [
        query_variable(n.NAMESPACE, "Namespace", n.AS_DESIRED, n.NAMESPACE),
        query_variable(
            n.LLMSERVICE, "LLMService", n.AS_DESIRED, n.LLMSERVICE, after=matchers(n.NAMESPACE)
        ),
    ]


def _gauge(metric: str, extra: str = "") -> str:
    selector = OPERATOR + (f", {extra}" if extra else "")
    return f"max by (llmservice) ({metric}{{{selector}}})"


def _signal_panel(
    title: str, description: str, signal: str, unit: str, maximum: float | None = None
) -> timeseries.Panel:
    return panel(
        title,
        description,
        [
            (_gauge(n.AS_SIGNAL, f'signal="{signal}"'), "{{llmservice}} signal"),
            (_gauge(n.AS_TARGET, f'signal="{signal}"'), "{{llmservice}} target"),
        ],
        unit=unit,
        width=8,
        maximum=maximum,
    )


def _demand_panel(
    title: str, description: str, demand: str, capacity: str, unit: str
) -> timeseries.Panel:
    """Demand against what the ready replicas carry (one replica's capacity x ready)."""
    per_replica = _gauge(n.AS_SIGNAL, f'signal="{capacity}"')
    return panel(
        title,
        description,
        [
            (_gauge(n.AS_SIGNAL, f'signal="{demand}"'), "{{llmservice}} demand"),
            (
                f"{per_replica} * {_gauge(n.AS_READY)}",
                "{{llmservice}} capacity of the ready replicas",
            ),
        ],
        unit=unit,
        width=8,
    )


def build() -> dash.Dashboard:
    board = dashboard(
        UID,
        TITLE,
        "What the operator's autoscaler saw and decided for each LLMService.",
        ["autoscaler"],
    )
    for variable in variables():
        board = board.with_variable(variable)
    return (
        board.with_row(dash.Row("Replicas"))
        .with_panel(
            panel(
                "Desired and ready replicas",
                "Replicas the autoscaler asks for, replicas ready to serve, and the LLMService's "
                "bounds.",
                [
                    (_gauge(n.AS_DESIRED), "{{llmservice}} desired"),
                    (_gauge(n.AS_READY), "{{llmservice}} ready"),
                    (_gauge(n.AS_MIN), "{{llmservice}} min"),
                    (_gauge(n.AS_MAX), "{{llmservice}} max"),
                ],
                unit=COUNT,
            )
        )
        .with_panel(
            panel(
                "Scaling decisions by direction and reason",
                "Each scale up or down the autoscaler wrote, and why.",
                [
                    (
                        events(n.AS_DECISIONS, OPERATOR, "llmservice, direction, reason"),
                        "{{llmservice}} {{direction}} {{reason}}",
                    )
                ],
                unit=COUNT,
            )
        )
        .with_row(dash.Row("Signals against targets"))
        .with_panel(
            _signal_panel(
                "Queue depth per replica",
                "Waiting requests per ready replica, against the LLMService's target.",
                n.SIGNAL_QUEUE_DEPTH,
                COUNT,
            )
        )
        .with_panel(
            _signal_panel(
                "TTFT p95",
                "Time to first token, p95 over the autoscaler's window, against the target.",
                n.SIGNAL_TTFT_P95,
                SECONDS,
            )
        )
        .with_panel(
            _signal_panel(
                "KV-cache usage",
                "Mean KV-cache usage of the ready replicas, against the target.",
                n.SIGNAL_KV_CACHE,
                RATIO,
                maximum=1,
            )
        )
        .with_row(dash.Row("Demand and capacity"))
        .with_panel(
            _demand_panel(
                "Demand and capacity: requests",
                "Arrivals (what finished, what the gateways turned away, and how much the backlog "
                "grew) over the demand window, against one replica's measured capacity times the "
                "ready replicas.",
                n.SIGNAL_DEMAND_RPS,
                n.SIGNAL_CAPACITY_RPS,
                REQUESTS_PER_S,
            )
        )
        .with_panel(
            _demand_panel(
                "Demand and capacity: tokens",
                "Prompt and generated tokens of those arrivals, against one replica's measured "
                "token throughput times the ready replicas.",
                n.SIGNAL_DEMAND_TPS,
                n.SIGNAL_CAPACITY_TPS,
                PER_S,
            )
        )
        .with_panel(
            panel(
                "Utilization and replicas needed",
                "Demand over the ready replicas' capacity, against targetUtilization; and the "
                "replicas demand and backlog call for before rounding, against those desired.",
                [
                    (
                        _gauge(n.AS_SIGNAL, f'signal="{n.SIGNAL_UTILIZATION}"'),
                        "{{llmservice}} utilization",
                    ),
                    (
                        _gauge(n.AS_TARGET, f'signal="{n.SIGNAL_UTILIZATION}"'),
                        "{{llmservice}} target",
                    ),
                    (
                        _gauge(n.AS_SIGNAL, f'signal="{n.SIGNAL_REPLICAS_NEEDED}"'),
                        "{{llmservice}} replicas needed",
                    ),
                    (_gauge(n.AS_DESIRED), "{{llmservice}} desired"),
                ],
                unit=COUNT,
                width=8,
            )
        )
        .with_panel(
            panel(
                "Reconciles by result",
                "The operator's reconciles of all LLMServices, by result (success, degraded, "
                "error): a failing reconcile shows here before it shows in a status.",
                [(f"sum by (result) (rate({n.RECONCILE}[$__rate_interval]))", "{{result}}")],
                unit=PER_S,
                width=24,
            )
        )
    )
