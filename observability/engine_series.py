"""Recording rules that give vLLM's and SGLang's series Conveyor's names.

Every dashboard panel and alert is written against Conveyor's runtime series (``names.py``).
A replica of an LLMService on vLLM or SGLang exports the same signals under its engine's own
names and labels (``model_name`` for ``model``, vLLM's ``finished_reason`` for
``finish_reason``, an ``engine`` index); these rules record them under Conveyor's names, with
Conveyor's labels, so the same panels and alerts show an LLMService of any engine. The scrape
labels (``namespace``, ``llmservice``, ``pod``) come from the pod as for any runtime pod.

Histograms are mapped bucket, sum and count alike (each engine keeps its own bucket bounds;
``histogram_quantile`` reads whatever bounds a series has). A signal an engine does not
export is left out for that engine (its panel shows no data for it, as it would anyway).
"""

from __future__ import annotations

from typing import Any

from conveyor.contracts.engine_load import SGLANG, VLLM
from conveyor.observability import names as n
from conveyor.runtime.metrics_names import VLLM_NAMES

HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")

ENGINE_GAUGES: dict[str, dict[str, str]] = {
    VLLM.engine: {k: VLLM_NAMES[k] for k in (n.RUNNING, n.WAITING, n.KV_CACHE_USAGE)},
    SGLANG.engine: {
        n.RUNNING: SGLANG.running,
        n.WAITING: SGLANG.waiting,
        n.KV_CACHE_USAGE: SGLANG.kv_cache_usage,
    },
}
ENGINE_COUNTERS: dict[str, dict[str, str]] = {
    VLLM.engine: {
        k: VLLM_NAMES[k]
        for k in (
            n.PROMPT_TOKENS,
            n.GENERATION_TOKENS,
            n.REQUEST_SUCCESS,
            n.PREFIX_QUERIES,
            n.PREFIX_HITS,
            n.PREEMPTIONS,
        )
    },
    SGLANG.engine: {
        n.PROMPT_TOKENS: SGLANG.prompt_tokens,
        n.GENERATION_TOKENS: SGLANG.generation_tokens,
        n.REQUEST_SUCCESS: SGLANG.requests,
        # SGLang counts the prompt tokens found in its radix cache among all prompt tokens
        n.PREFIX_QUERIES: SGLANG.prompt_tokens,
        n.PREFIX_HITS: "sglang:cached_tokens_total",
        n.PREEMPTIONS: "sglang:num_retracted_requests_total",
    },
}
ENGINE_HISTOGRAMS: dict[str, dict[str, str]] = {
    VLLM.engine: {k: VLLM_NAMES[k] for k in (n.TTFT, n.TPOT, n.ITL, n.E2E, n.QUEUE_TIME)},
    SGLANG.engine: {
        n.TTFT: SGLANG.ttft,
        n.ITL: "sglang:inter_token_latency_seconds",
        n.E2E: "sglang:e2e_request_latency_seconds",
        n.QUEUE_TIME: "sglang:queue_time_seconds",
    },
}

ENGINE_ONLY_LABELS = ("model_name", "engine", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank")
"""Labels the engines add that Conveyor's series do not have: vLLM's engine-core index,
SGLang's parallel ranks (summed away once mapped)."""


def conveyor_labels(expr: str, *, finish_reason: bool = False) -> str:
    """``expr`` (an engine's series) with Conveyor's labels: ``model`` from ``model_name``,
    ``finish_reason`` from vLLM's ``finished_reason`` (``finish_reason``), the engine's own
    labels summed away."""
    expr = f'label_replace({expr}, "{n.MODEL}", "$1", "model_name", "(.+)")'
    dropped: tuple[str, ...] = ENGINE_ONLY_LABELS
    if finish_reason:
        expr = f'label_replace({expr}, "finish_reason", "$1", "finished_reason", "(.+)")'
        dropped = (*dropped, "finished_reason")
    return f"sum without ({', '.join(dropped)}) ({expr})"


def not_conveyor(expr: str) -> str:
    """``expr`` less the pods of Conveyor's own replicas, which export vLLM's names too with
    ``--vllm-metrics``: their own series already have Conveyor's names, and a recorded copy
    would be a second series with the same labels."""
    return f"({expr}) unless on ({n.NAMESPACE}, {n.POD}) {n.STEP_DURATION}_count"


def engine_rules() -> list[dict[str, Any]]:
    """One recording rule per Conveyor series that an engine maps to: each engine's own
    series, with Conveyor's labels, joined by ``or`` (one rule per name, as promtool wants)."""
    sources: dict[str, list[str]] = {}
    for engine in (VLLM.engine, SGLANG.engine):
        own = not_conveyor if engine == VLLM.engine else str
        for ours, theirs in {**ENGINE_GAUGES[engine], **ENGINE_COUNTERS[engine]}.items():
            expr = conveyor_labels(theirs, finish_reason=ours == n.REQUEST_SUCCESS)
            sources.setdefault(ours, []).append(own(expr))
        for ours, theirs in ENGINE_HISTOGRAMS[engine].items():
            for suffix in HISTOGRAM_SUFFIXES:
                sources.setdefault(ours + suffix, []).append(own(conveyor_labels(theirs + suffix)))
    return [{"record": ours, "expr": "\nor\n".join(exprs)} for ours, exprs in sources.items()]
