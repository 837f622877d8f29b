"""One load record per replica, whatever engine it runs: the adapters of Conveyor, vLLM, SGLang.

The gateway's poller and the autoscaler read every replica as a :class:`ReplicaLoad` (running,
waiting, KV-cache usage 0..1, batch capacity, ready) and stay blind to the engine behind it.
Each engine says these things its own way:

- Conveyor writes them as the ``GET /load`` JSON document (``conveyor.contracts.load``);
- vLLM exports them on ``GET /metrics`` as ``vllm:num_requests_running``,
  ``vllm:num_requests_waiting`` and ``vllm:kv_cache_usage_perc`` (a ratio, 0..1, despite its
  name);
- SGLang (started with ``--enable-metrics``) as ``sglang:num_running_reqs``,
  ``sglang:num_queue_reqs`` and ``sglang:token_usage`` (0..1).

A replica that answers ``/metrics`` at all has loaded its model (neither vLLM's nor SGLang's
server listens before), so it is ready. Neither exports its batch capacity
(``--max-num-seqs`` / ``--max-running-requests``) or SGLang its queue bound
(``--max-queued-requests``) as a gauge: the gateway and the autoscaler know them from the
LLMService that started the replica (:class:`Limits`, ``spec.runtime``), and where it leaves
them unset the record carries the engine's documented default batch and no queue bound.

The autoscaler also reads the TTFT histogram and the finished-request and token counters from
``/metrics``: :class:`EngineMetrics` names them for vLLM and SGLang (Conveyor's own names live
in ``conveyor.runtime.metrics_names``, which this module may not import).

Parsing is a scan of the lines that start with the few names wanted, not a full Prometheus
parse: the gateway reads every replica five times a second, and vLLM's exposition is long.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from conveyor.contracts.load import ReplicaLoad

ENGINES = ("conveyor", "vllm", "sglang")
"""The values of an LLMService's ``spec.engine``."""

LOAD_PATH = "/load"
"""Where Conveyor replicas say their load."""
METRICS_PATH = "/metrics"
"""Where vLLM and SGLang replicas say theirs (Prometheus text)."""


@dataclass(frozen=True)
class EngineMetrics:
    """What one engine calls the signals routing and scaling need, in its Prometheus text."""

    engine: str
    prefix: str
    """Every family of the engine starts with it (``vllm:``); how a scrape is recognised."""
    running: str
    """Gauge: requests in the running batch."""
    waiting: str
    """Gauge: requests queued."""
    kv_cache_usage: str
    """Gauge: KV cache in use, 0..1."""
    ttft: str
    """Histogram: arrival to first token, seconds."""
    requests: str
    """Counter sample: finished requests."""
    prompt_tokens: str
    """Counter sample: prompt tokens processed."""
    generation_tokens: str
    """Counter sample: tokens generated."""
    default_max_running: int
    """The engine's default batch capacity, which it does not export."""


VLLM = EngineMetrics(
    engine="vllm",
    prefix="vllm:",
    running="vllm:num_requests_running",
    waiting="vllm:num_requests_waiting",
    kv_cache_usage="vllm:kv_cache_usage_perc",
    ttft="vllm:time_to_first_token_seconds",
    requests="vllm:request_success_total",
    prompt_tokens="vllm:prompt_tokens_total",
    generation_tokens="vllm:generation_tokens_total",
    default_max_running=256,  # vLLM's --max-num-seqs default
)
SGLANG = EngineMetrics(
    engine="sglang",
    prefix="sglang:",
    running="sglang:num_running_reqs",
    waiting="sglang:num_queue_reqs",
    kv_cache_usage="sglang:token_usage",
    ttft="sglang:time_to_first_token_seconds",
    requests="sglang:num_requests_total",
    prompt_tokens="sglang:prompt_tokens_total",
    generation_tokens="sglang:generation_tokens_total",
    default_max_running=256,  # SGLang sizes --max-running-requests from memory; a round guess
)
METRICS_ENGINES: dict[str, EngineMetrics] = {e.engine: e for e in (VLLM, SGLANG)}
"""The engines whose load is read from ``/metrics``, by ``spec.engine``."""


@dataclass(frozen=True)
class Limits:
    """The batch and queue bounds a replica was started with, for a record read from
    ``/metrics``, where the engine does not say them. None: the engine's own default."""

    max_running: int | None = None
    """``spec.runtime.maxRunningRequests`` (vLLM's ``--max-num-seqs``)."""
    max_queued: int | None = None
    """``spec.runtime.maxQueuedRequests`` (SGLang's ``--max-queued-requests``)."""

    @classmethod
    def of_spec(cls, spec: Mapping[str, Any]) -> Limits:
        """The limits an LLMService's ``spec`` gives its replicas."""
        runtime = spec.get("runtime") or {}
        running, queued = runtime.get("maxRunningRequests"), runtime.get("maxQueuedRequests")
        return cls(
            running if type(running) is int and running > 0 else None,
            queued if type(queued) is int and queued >= 0 else None,
        )


NO_LIMITS = Limits()


def load_path(engine: str) -> str:
    """Where a replica of ``engine`` says its load: ``/load`` for Conveyor, else ``/metrics``."""
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}: one of {', '.join(ENGINES)}")
    return METRICS_PATH if engine in METRICS_ENGINES else LOAD_PATH


def engine_of(text: str) -> EngineMetrics | None:
    """The engine whose families a Prometheus text carries; None for any other text."""
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            name = line[7:]
            for engine in METRICS_ENGINES.values():
                if name.startswith(engine.prefix):
                    return engine
    return None


def samples(text: str, names: Iterable[str]) -> dict[str, list[float]]:
    """The values of the samples called ``names`` (any labels) in Prometheus text."""
    wanted = set(names)
    found: dict[str, list[float]] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        space = line.find(" ")
        end = space if brace < 0 or 0 <= space < brace else brace
        if end <= 0 or line[:end] not in wanted:
            continue
        rest = line[line.rfind("}") + 1 :] if end == brace else line[end:]
        value = rest.split()
        if not value:
            raise ValueError(f"Prometheus sample without a value: {line[:120]!r}")
        try:
            found.setdefault(line[:end], []).append(float(value[0]))
        except ValueError:
            raise ValueError(f"Prometheus sample with a bad value: {line[:120]!r}") from None
    return found


def load_from_metrics(
    text: str, engine: EngineMetrics | None = None, limits: Limits = NO_LIMITS
) -> ReplicaLoad:
    """The load record of a vLLM or SGLang replica from its ``/metrics`` text, with the batch
    and queue bounds of ``limits`` (the engine's default batch where it has none).

    Running and waiting are summed over label sets (one per engine core or rank), KV usage
    averaged. ValueError when the text is no known engine's or lacks a gauge the record needs.
    """
    engine = engine or engine_of(text)
    if engine is None:
        raise ValueError(
            f"/metrics carries none of {', '.join(e.prefix for e in METRICS_ENGINES.values())}: "
            "not a vLLM or SGLang replica (SGLang needs --enable-metrics)"
        )
    values = samples(text, (engine.running, engine.waiting, engine.kv_cache_usage))
    for name in (engine.running, engine.waiting, engine.kv_cache_usage):
        if not values.get(name):
            raise ValueError(f"{engine.engine} /metrics has no {name} sample")
    kv = values[engine.kv_cache_usage]
    usage = sum(kv) / len(kv)
    return ReplicaLoad(
        running=_count(values[engine.running]),
        waiting=_count(values[engine.waiting]),
        kv_cache_usage=min(1.0, max(0.0, usage)) if math.isfinite(usage) else 0.0,
        max_running_requests=limits.max_running or engine.default_max_running,
        max_queued_requests=limits.max_queued,
        ready=True,
        engine=engine.engine,
    )


def read_load(path: str, body: str | bytes, limits: Limits = NO_LIMITS) -> ReplicaLoad:
    """The load record from what ``path`` (``/load`` or ``/metrics``) answered; ValueError
    naming what is wrong. ``limits`` fill in what ``/metrics`` does not say (``/load`` says
    its own)."""
    text = body.decode(errors="replace") if isinstance(body, bytes) else body
    if path == LOAD_PATH:
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"/load is not JSON: {exc}") from None
        return ReplicaLoad.from_json(doc)
    if path == METRICS_PATH:
        return load_from_metrics(text, limits=limits)
    raise ValueError(f"no load is read from {path!r}: {LOAD_PATH} or {METRICS_PATH}")


def _count(values: list[float]) -> int:
    total = sum(v for v in values if math.isfinite(v))
    return max(0, round(total))
