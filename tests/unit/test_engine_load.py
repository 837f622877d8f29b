"""The engine adapters (``conveyor.contracts.engine_load``) on each engine's own exposition text.

vLLM's is a real scrape of vLLM for CPU 0.32.0 (``exposition/vllm-0.32.0-cpu.txt``, taken
while it had requests running and queued). SGLang does not install on this machine, so its
text is written here by prometheus_client (the library SGLang exports with) from SGLang's own
metric definitions: the names, help texts, label names and bucket bounds of
``python/sglang/srt/metrics/collector.py`` (SchedulerMetricsCollector and
TokenizerMetricsCollector).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from conveyor.contracts.engine_load import (
    SGLANG,
    VLLM,
    Limits,
    engine_of,
    load_from_metrics,
    load_path,
    read_load,
    samples,
)
from conveyor.contracts.load import ReplicaLoad

VLLM_TEXT = (Path(__file__).parent / "exposition" / "vllm-0.32.0-cpu.txt").read_text()

SGLANG_SCHEDULER_LABELS = ("model_name", "engine_type", "tp_rank", "pp_rank")
SGLANG_TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)


def sglang_text(
    running: int, queued: int, token_usage: float, ttfts: tuple[float, ...] = ()
) -> str:
    """SGLang's /metrics (with --enable-metrics) as its collectors would write it, for one
    scheduler (tp rank 0) and its tokenizer manager: from SGLang's metric definitions."""
    registry = CollectorRegistry()
    scheduler = dict(
        zip(SGLANG_SCHEDULER_LABELS, ("Qwen/Qwen2.5-0.5B", "unified", "0", "0"), strict=True)
    )

    def gauge(name: str, doc: str, value: float) -> None:
        Gauge(name, doc, list(scheduler), registry=registry).labels(**scheduler).set(value)

    gauge("sglang:num_running_reqs", "The number of running requests.", running)
    gauge("sglang:num_used_tokens", "The number of used tokens.", 1234)
    gauge("sglang:token_usage", "The token usage.", token_usage)
    gauge("sglang:gen_throughput", "The generation throughput (token/s).", 42.5)
    gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.", queued)
    gauge("sglang:cache_hit_rate", "The prefix cache hit rate.", 0.25)
    gauge(
        "sglang:max_total_num_tokens", "Maximum total number of tokens in the KV cache pool.", 8192
    )
    tokenizer = {"model_name": "Qwen/Qwen2.5-0.5B"}
    for name, doc, value in (
        ("sglang:prompt_tokens", "Number of prefill tokens processed.", 900),
        ("sglang:generation_tokens", "Number of generation tokens processed.", 300),
        ("sglang:num_requests", "Number of requests processed.", 12),
    ):
        Counter(name, doc, list(tokenizer), registry=registry).labels(**tokenizer).inc(value)
    ttft = Histogram(
        "sglang:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        list(tokenizer),
        buckets=SGLANG_TTFT_BUCKETS,
        registry=registry,
    ).labels(**tokenizer)
    for value in ttfts:
        ttft.observe(value)
    return generate_latest(registry).decode()


def test_vllm_scrape_reads_as_one_load_record() -> None:
    assert engine_of(VLLM_TEXT) is VLLM
    # the record says what vLLM's own gauges say, read by the full Prometheus parser
    from prometheus_client.parser import text_string_to_metric_families

    gauges = {
        s.name: s.value
        for f in text_string_to_metric_families(VLLM_TEXT)
        for s in f.samples
        if s.name in (VLLM.running, VLLM.waiting, VLLM.kv_cache_usage)
    }
    load = load_from_metrics(VLLM_TEXT)
    assert load.running == gauges[VLLM.running] > 0  # the scrape was taken under load
    assert load.waiting == gauges[VLLM.waiting] > 0
    assert load.kv_cache_usage == pytest.approx(gauges[VLLM.kv_cache_usage])
    assert 0 < load.kv_cache_usage <= 1
    assert load.ready and load.max_running_requests == VLLM.default_max_running
    assert load.max_queued_requests is None
    # every name the autoscaler reads is in a real scrape
    found = samples(
        VLLM_TEXT, (VLLM.requests, VLLM.prompt_tokens, VLLM.generation_tokens, f"{VLLM.ttft}_count")
    )
    assert set(found) == {
        VLLM.requests,
        VLLM.prompt_tokens,
        VLLM.generation_tokens,
        f"{VLLM.ttft}_count",
    }


def test_the_bounds_an_engine_does_not_export_come_from_the_llmservice() -> None:
    limits = Limits.of_spec({"runtime": {"maxRunningRequests": 8, "maxQueuedRequests": 0}})
    assert limits == Limits(max_running=8, max_queued=0)
    load = load_from_metrics(VLLM_TEXT, limits=limits)
    assert (load.max_running_requests, load.max_queued_requests) == (8, 0)
    assert read_load("/metrics", VLLM_TEXT, limits) == load
    assert Limits.of_spec({}) == Limits.of_spec({"runtime": {}}) == Limits()
    unset = load_from_metrics(VLLM_TEXT, limits=Limits.of_spec({"runtime": {"dtype": "auto"}}))
    assert (unset.max_running_requests, unset.max_queued_requests) == (256, None)


def test_sglang_text_from_its_metric_definitions_reads_as_one_load_record() -> None:
    text = sglang_text(running=5, queued=3, token_usage=0.625)
    assert engine_of(text) is SGLANG
    assert load_from_metrics(text) == ReplicaLoad(
        running=5,
        waiting=3,
        kv_cache_usage=0.625,
        max_running_requests=SGLANG.default_max_running,
        max_queued_requests=None,
        ready=True,
        engine="sglang",
    )
    assert read_load("/metrics", text.encode()) == load_from_metrics(text)


def test_conveyor_load_document_is_read_as_before() -> None:
    record = ReplicaLoad(2, 1, 0.5, 8, 16, True)
    import json

    assert read_load("/load", json.dumps(record.to_json())) == record
    assert load_path("conveyor") == "/load"
    assert load_path("vllm") == load_path("sglang") == "/metrics"
    with pytest.raises(ValueError, match="unknown engine"):
        load_path("tgi")


def test_ranks_are_summed_and_usage_averaged() -> None:
    text = (
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 2.0\n'
        "# TYPE vllm:num_requests_waiting gauge\n"
        'vllm:num_requests_waiting{engine="0",model_name="m"} 1.0\n'
        'vllm:num_requests_waiting{engine="1",model_name="m"} 0.0\n'
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        'vllm:kv_cache_usage_perc{engine="0",model_name="a b{c}"} 0.2\n'
        'vllm:kv_cache_usage_perc{engine="1",model_name="a b{c}"} 0.4\n'
    )
    load = load_from_metrics(text)
    assert (load.running, load.waiting) == (5, 1)
    assert load.kv_cache_usage == pytest.approx(0.3)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (
            "# TYPE conveyor_num_requests_running gauge\nconveyor_num_requests_running 1\n",
            "none of",
        ),
        ("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 1\n", "waiting"),
        (
            '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{a="b"}\n',
            "without a value",
        ),
        ("# TYPE sglang:num_queue_reqs gauge\nsglang:num_queue_reqs one\n", "bad value"),
    ],
)
def test_what_is_not_an_engines_load_is_a_value_error_that_says_why(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        load_from_metrics(text)


def test_a_load_document_that_is_not_json_says_so() -> None:
    with pytest.raises(ValueError, match="not JSON"):
        read_load("/load", "<html>")
    with pytest.raises(ValueError, match="no load is read"):
        read_load("/health", "ok")
