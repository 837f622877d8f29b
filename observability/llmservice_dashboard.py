"""The "LLMService overview" dashboard: what one model's users feel (latency, throughput,
errors) and why (queueing, KV cache, preemptions), per LLMService and per replica."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as dash

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
    mean,
    panel,
    quantile,
    quantile_queries,
    query_variable,
    rate,
)

UID = "conveyor-llmservice"
TITLE = "Conveyor / LLMService overview"

DEFAULT_TTFT_TARGET_S = 1.0
"""Where the TTFT panel's dashed line sits when no LLMService sets a target (the target
series itself, from the autoscaler, is drawn next to the quantiles)."""

RUNTIME = matchers(n.NAMESPACE, n.LLMSERVICE, n.MODEL, n.POD)
"""Runtime series of the selected namespaces, LLMServices, models and pods."""
GATEWAY = matchers(n.NAMESPACE, n.MODEL)
"""Gateway series of the selected namespaces and models (a gateway serves a whole namespace)."""
AUTOSCALER = matchers(n.NAMESPACE, n.LLMSERVICE)


def variables() -> list[dash.QueryVariable]:
    after_ns = matchers(n.NAMESPACE)
    after_svc = matchers(n.NAMESPACE, n.LLMSERVICE)
    after_model = matchers(n.NAMESPACE, n.LLMSERVICE, n.MODEL)
    return [
        query_variable(n.NAMESPACE, "Namespace", n.RUNNING, n.NAMESPACE),
        query_variable(n.LLMSERVICE, "LLMService", n.RUNNING, n.LLMSERVICE, after=after_ns),
        query_variable(n.MODEL, "Model", n.RUNNING, n.MODEL, after=after_svc),
        query_variable(n.POD, "Replica", n.RUNNING, n.POD, after=after_model),
    ]


def build() -> dash.Dashboard:
    board = dashboard(
        UID,
        TITLE,
        "Latency (TTFT, TPOT), throughput and errors of LLMServices, and per-replica queueing, "
        "KV cache and preemptions.",
        ["llmservice"],
    )
    for variable in variables():
        board = board.with_variable(variable)
    svc = f"{n.LLMSERVICE}"
    ttft_target = (
        f'max by ({svc}) ({n.AS_TARGET}{{{AUTOSCALER}, signal="{n.SIGNAL_TTFT_P95}"}})',
        "{{llmservice}} target (p95)",
    )
    error_codes = matchers(n.NAMESPACE, n.MODEL) + ', code=~"4..|5.."'
    return (
        board.with_row(dash.Row("Traffic"))
        .with_panel(
            panel(
                "Requests by status code",
                "Requests answered by the namespace's gateways for these models, by HTTP status.",
                [(rate(n.GW_REQUESTS, GATEWAY, "model, code"), "{{model}} {{code}}")],
                unit=REQUESTS_PER_S,
            )
        )
        .with_panel(
            panel(
                "Error ratio",
                "Share of the gateways' answers that were 4xx or 5xx (429: over the queue bound; "
                "499: the client went away), per model and code.",
                [
                    (
                        f"{events(n.GW_REQUESTS, error_codes, 'model, code')} / ignoring(code) "
                        f"group_left {events(n.GW_REQUESTS, GATEWAY, 'model')}",
                        "{{model}} {{code}}",
                    )
                ],
                unit=RATIO,
                threshold_steps=((None, "green"), (0.01, "red")),
            )
        )
        .with_panel(
            panel(
                "Finished requests by reason",
                "Requests the replicas finished: stop (end of sequence), length (max_tokens), "
                "abort (the client went away or the request was cancelled).",
                [
                    (
                        rate(n.REQUEST_SUCCESS, RUNTIME, "llmservice, finish_reason"),
                        "{{llmservice}} {{finish_reason}}",
                    )
                ],
                unit=REQUESTS_PER_S,
                stacked=True,
            )
        )
        .with_panel(
            panel(
                "Tokens per second",
                "Prompt tokens processed (prefill) and tokens generated (decode).",
                [
                    (rate(n.PROMPT_TOKENS, RUNTIME, svc), "{{llmservice}} prompt"),
                    (rate(n.GENERATION_TOKENS, RUNTIME, svc), "{{llmservice}} generation"),
                ],
                unit=PER_S,
            )
        )
        .with_row(dash.Row("Latency"))
        .with_panel(
            panel(
                "Time to first token",
                "Arrival at the replica to the first generated token, p50/p95/p99; the dashed "
                "series is the LLMService's TTFT p95 target (autoscaling).",
                [*quantile_queries(n.TTFT, RUNTIME, svc, "{{llmservice}}"), ttft_target],
                unit=SECONDS,
                threshold_steps=((None, "green"), (DEFAULT_TTFT_TARGET_S, "red")),
            )
        )
        .with_panel(
            panel(
                "Time per output token",
                "Per request: (finish - first token) / (output tokens - 1), p50/p95/p99.",
                quantile_queries(n.TPOT, RUNTIME, svc, "{{llmservice}}"),
                unit=SECONDS,
            )
        )
        .with_panel(
            panel(
                "Inter-token latency",
                "Every gap between two streamed tokens, p50/p95/p99.",
                quantile_queries(n.ITL, RUNTIME, svc, "{{llmservice}}"),
                unit=SECONDS,
            )
        )
        .with_panel(
            panel(
                "End-to-end request latency",
                "Arrival at the replica to the last token, p50/p95/p99.",
                quantile_queries(n.E2E, RUNTIME, svc, "{{llmservice}}"),
                unit=SECONDS,
            )
        )
        .with_panel(
            panel(
                "Queue time",
                "Arrival at the replica to its first scheduling, p50/p95/p99, and the mean.",
                [
                    *quantile_queries(n.QUEUE_TIME, RUNTIME, svc, "{{llmservice}}"),
                    (mean(n.QUEUE_TIME, RUNTIME, svc), "{{llmservice}} mean"),
                ],
                unit=SECONDS,
            )
        )
        .with_row(dash.Row("Replicas"))
        .with_panel(
            panel(
                "Running requests per replica",
                "Requests holding KV blocks in each replica's running batch.",
                [(f"sum by (pod) ({n.RUNNING}{{{RUNTIME}}})", "{{pod}}")],
                unit=COUNT,
                width=8,
            )
        )
        .with_panel(
            panel(
                "Waiting requests per replica",
                "Each replica's queue depth: what the autoscaler scales on.",
                [(f"sum by (pod) ({n.WAITING}{{{RUNTIME}}})", "{{pod}}")],
                unit=COUNT,
                width=8,
            )
        )
        .with_panel(
            panel(
                "KV-cache usage per replica",
                "Used KV blocks over all KV blocks; above 0.95 for long, requests get preempted.",
                [(f"max by (pod) ({n.KV_CACHE_USAGE}{{{RUNTIME}}})", "{{pod}}")],
                unit=RATIO,
                maximum=1,
                width=8,
                threshold_steps=((None, "green"), (0.8, "orange"), (0.95, "red")),
            )
        )
        .with_panel(
            panel(
                "Prefix-cache hit rate",
                "Prompt tokens found in the prefix cache over prompt tokens looked up.",
                [
                    (
                        f"{rate(n.PREFIX_HITS, RUNTIME, svc)} / {rate(n.PREFIX_QUERIES, RUNTIME, svc)}",
                        "{{llmservice}}",
                    )
                ],
                unit=RATIO,
                maximum=1,
                width=8,
            )
        )
        .with_panel(
            panel(
                "Preemptions per replica",
                "Requests preempted for lack of KV blocks (recomputed later): the KV cache is too "
                "small for the load.",
                [(rate(n.PREEMPTIONS, RUNTIME, "pod"), "{{pod}}")],
                unit=PER_S,
                width=8,
            )
        )
        .with_panel(
            panel(
                "TTFT p95 per replica",
                "One slow replica shows here before it moves the service's quantiles.",
                [(quantile(0.95, n.TTFT, RUNTIME, "pod"), "{{pod}}")],
                unit=SECONDS,
                width=8,
            )
        )
    )
