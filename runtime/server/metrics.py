"""Prometheus metrics of one replica, on a registry of its own (never the global default).

Request-level histograms are observed as outputs come back from the engine; gauges and
token counters are read at scrape time from the engine's latest stats snapshot, so they
cost nothing between scrapes and can never drift from what the engine counted.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from conveyor.runtime import metrics_names as names

# Fine enough for millisecond TPOT on a GPU and multi-second TTFT under load.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)
TOKEN_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
)


def _decade_steps(low: float, high: float) -> tuple[float, ...]:
    """The 1, 2.5 and 5 of each power of ten from ``low`` to ``high``, both included; each
    parsed from its decimal spelling, so ``0.0025`` is the float that literal would give."""
    steps = (float(f"{m}e{e}") for e in range(-6, 4) for m in ("1", "2.5", "5"))
    return tuple(v for v in steps if low <= v <= high)


REQUEST_LATENCY_BUCKETS = (
    *_decade_steps(0.01, 10.0),
    *(15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0),
)
QUEUE_BUCKETS = (*_decade_steps(0.0005, 10.0), 20.0, 40.0, 80.0, 160.0, 320.0)
FAST_BUCKETS = _decade_steps(0.00001, 1.0)

FINISH_REASONS = ("stop", "length", "abort")


class ServerMetrics:
    """The replica's metrics; names from ``conveyor.runtime.metrics_names``, label ``model``."""

    def __init__(self, model: str, vllm_names: bool = False) -> None:
        self.model = model
        self.registry = CollectorRegistry(auto_describe=True)
        self._vllm: CollectorRegistry | None = None
        """With ``vllm_names``: the same series again, under vLLM's names and labels."""
        if vllm_names:
            self._vllm = CollectorRegistry(auto_describe=False)
            self._vllm.register(_VllmNames(self.registry))
        labels = [names.MODEL_LABEL]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            h = Histogram(
                name.removesuffix("_seconds") + "_seconds",
                doc,
                labels,
                buckets=buckets,
                registry=self.registry,
            )
            return h.labels(model)

        self.ttft = histogram(
            names.TIME_TO_FIRST_TOKEN, "Arrival to first generated token.", TTFT_BUCKETS
        )
        self.tpot = histogram(
            names.TIME_PER_OUTPUT_TOKEN,
            "Per request: (finish - first token) / (output tokens - 1).",
            TOKEN_LATENCY_BUCKETS,
        )
        self.itl = histogram(
            names.INTER_TOKEN_LATENCY, "Gap between two streamed tokens.", TOKEN_LATENCY_BUCKETS
        )
        self.e2e = histogram(
            names.E2E_REQUEST_LATENCY, "Arrival to finish.", REQUEST_LATENCY_BUCKETS
        )
        self.queue_time = histogram(
            names.REQUEST_QUEUE_TIME, "Arrival to first scheduled.", QUEUE_BUCKETS
        )
        self.step_duration = histogram(
            names.ENGINE_STEP_DURATION,
            "One engine step (schedule, forward, sample, postprocess).",
            (*FAST_BUCKETS, 2.5, 5.0),
        )
        self.tokenize = histogram(
            names.TOKENIZE_DURATION,
            "Tokenising one request's prompt (chat template included).",
            FAST_BUCKETS,
        )
        self.detokenize = histogram(
            names.DETOKENIZE_DURATION,
            "Detokenising one request's new tokens of one step.",
            FAST_BUCKETS,
        )
        success = Counter(
            names.REQUEST_SUCCESS.removesuffix("_total"),
            "Finished requests by finish reason.",
            [names.MODEL_LABEL, names.FINISH_REASON_LABEL],
            registry=self.registry,
        )
        self._success = {reason: success.labels(model, reason) for reason in FINISH_REASONS}

    def track_engine(self, snapshot: Callable[[], Any | None]) -> None:
        """Export gauges and counters from ``snapshot()`` (the engine client's latest stats)."""
        self.registry.register(_EngineStatsCollector(self.model, snapshot))

    def request_finished(self, reason: str) -> None:
        self._success[reason].inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of everything above."""
        text = generate_latest(self.registry)
        return text if self._vllm is None else text + generate_latest(self._vllm)


class _VllmNames(Collector):
    """The series vLLM also exports, renamed as vLLM names them, read from ``source`` at each
    scrape (nothing is observed twice): ``vllm:num_requests_waiting{engine="0",
    model_name=...}`` and the rest of ``names.VLLM_NAMES``, for tools written against vLLM's
    metrics (the Gateway API Inference Extension's endpoint picker, KEDA or HPA rules, vLLM's
    Grafana dashboards)."""

    def __init__(self, source: CollectorRegistry) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        for metric in self._source.collect():
            exposed = metric.name + ("_total" if metric.type == "counter" else "")
            theirs = names.VLLM_NAMES.get(exposed)
            if theirs is None:
                continue
            family = theirs.removesuffix("_total") if metric.type == "counter" else theirs
            renamed = Metric(family, metric.documentation, metric.type)
            for sample in metric.samples:
                labels = {names.VLLM_LABELS.get(k, k): v for k, v in sample.labels.items()}
                renamed.samples.append(
                    sample._replace(
                        name=family + sample.name.removeprefix(metric.name),
                        labels={"engine": "0", **labels},
                    )
                )
            yield renamed


class _EngineStatsCollector(Collector):
    """Gauges and monotonic counters copied from the engine's stats at scrape time."""

    _COUNTERS = (
        (
            names.PREFIX_CACHE_QUERIES,
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
        ),
        (names.PREFIX_CACHE_HITS, "prefix_cache_hits", "Prompt tokens found in the prefix cache."),
        (names.PROMPT_TOKENS, "prompt_tokens", "Prompt tokens processed."),
        (names.GENERATION_TOKENS, "generation_tokens", "Tokens generated."),
        (names.NUM_PREEMPTIONS, "preemptions", "Requests preempted for lack of KV blocks."),
    )

    def __init__(self, model: str, stats: Callable[[], Any | None]) -> None:
        self._model = model
        self._stats = stats

    def describe(self) -> Iterator[Metric]:
        return self._families(None)

    def collect(self) -> Iterator[Metric]:
        return self._families(self._stats())

    def _families(self, stats: Any | None) -> Iterator[Metric]:
        labels = [names.MODEL_LABEL]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric([self._model], value)
            return g

        yield gauge(
            names.NUM_REQUESTS_RUNNING,
            "Requests holding KV blocks in the running batch.",
            stats.num_running if stats else 0,
        )
        yield gauge(
            names.NUM_REQUESTS_WAITING,
            "Queued requests (the queue depth).",
            stats.num_waiting if stats else 0,
        )
        yield gauge(
            names.KV_CACHE_USAGE,
            "Used KV blocks / total KV blocks.",
            stats.kv_cache_usage if stats else 0.0,
        )
        info = GaugeMetricFamily(
            names.LORA_REQUESTS_INFO,
            "LoRA adapters of running and waiting requests (labels), at the scrape's Unix time.",
            labels=[*labels, *names.LORA_LABELS],
        )
        if stats is not None and stats.max_loras:
            running, waiting = (",".join(stats.running_loras), ",".join(stats.waiting_loras))
            info.add_metric([self._model, str(stats.max_loras), running, waiting], time.time())
        yield info
        for name, field_name, doc in self._COUNTERS:
            c = CounterMetricFamily(name.removesuffix("_total"), doc, labels=labels)
            c.add_metric([self._model], getattr(stats, field_name) if stats else 0)
            yield c
