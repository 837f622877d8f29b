"""The figures of a ``conveyor bench serve`` run: per-request timings, their summary, and
the server's own counters before and after."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import httpx

from conveyor.bench.stats import describe
from conveyor.runtime import metrics_names as names


@dataclass
class RequestResult:
    ok: bool = False
    error: str | None = None
    start: float = 0.0
    ttft: float | None = None
    e2e: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    chunk_times: list[float] = field(default_factory=list)
    """Arrival time of every chunk that carried text, relative to the run's start."""

    @property
    def itls(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in itertools.pairwise(t)]

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if r.error:
            errors[r.error] = errors.get(r.error, 0) + 1
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    summary: dict[str, Any] = {
        "num_requests": len(results),
        "completed": len(ok),
        "errors": errors,
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "input_throughput": prompt_tokens / duration if duration else 0.0,
        "output_throughput": output_tokens / duration if duration else 0.0,
        "total_token_throughput": (prompt_tokens + output_tokens) / duration if duration else 0.0,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
    }
    summary.update(describe("ttft", [r.ttft for r in ok if r.ttft is not None]))
    summary.update(describe("tpot", [t for r in ok if (t := r.tpot) is not None]))
    summary.update(describe("itl", [x for r in ok for x in r.itls]))
    summary.update(describe("e2e", [r.e2e for r in ok if r.e2e is not None]))
    return summary


async def scrape_metrics(http: httpx.AsyncClient) -> dict[str, float] | None:
    """The server's counters (a runtime replica's; a gateway has none of these)."""
    try:
        r = await http.get("/metrics")
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {
        names.PREFIX_CACHE_QUERIES,
        names.PREFIX_CACHE_HITS,
        names.NUM_PREEMPTIONS,
        names.PROMPT_TOKENS,
        names.GENERATION_TOKENS,
        f"{names.ENGINE_STEP_DURATION}_sum",
        f"{names.ENGINE_STEP_DURATION}_count",
        f"{names.TOKENIZE_DURATION}_sum",
        f"{names.TOKENIZE_DURATION}_count",
        f"{names.DETOKENIZE_DURATION}_sum",
        f"{names.DETOKENIZE_DURATION}_count",
    }
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            if sample.name in wanted:
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def server_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    queries = d.get(names.PREFIX_CACHE_QUERIES, 0.0)
    steps = d.get(f"{names.ENGINE_STEP_DURATION}_count", 0.0)
    step_s = d.get(f"{names.ENGINE_STEP_DURATION}_sum", 0.0)
    tok_n = d.get(f"{names.TOKENIZE_DURATION}_count", 0.0)
    detok_s = d.get(f"{names.DETOKENIZE_DURATION}_sum", 0.0)
    return {
        "prefix_cache_hit_rate": d.get(names.PREFIX_CACHE_HITS, 0.0) / queries if queries else None,
        "preemptions": int(d.get(names.NUM_PREEMPTIONS, 0.0)),
        "engine_steps": int(steps),
        "step_ms_mean": 1000 * step_s / steps if steps else None,
        "tokenize_ms_mean": 1000 * d.get(f"{names.TOKENIZE_DURATION}_sum", 0.0) / tok_n
        if tok_n
        else None,
        # All detokenising of one step's outputs, summed over its requests, per step.
        "detokenize_ms_per_step": 1000 * detok_s / steps if steps else None,
        "detokenize_share_of_step": detok_s / step_s if step_s else None,
    }
