"""The autoscaler's timer on a vLLM and an SGLang LLMService: everything from /metrics under the
engine's own names, through the engine adapter; ``decide`` sees the same signals as for
Conveyor's runtime. Faked at the same boundaries as test_autoscaler_timer (an unprepared URL,
such as a /load these engines do not have, fails the test)."""

from __future__ import annotations

import pytest
from autoscaler_fakes import NS, World, endpoint_slice, gateway_metrics, llmservice
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from conveyor.contracts.engine_load import SGLANG, VLLM, EngineMetrics
from conveyor.operator.autoscaler_observe import Endpoint
from conveyor.operator.reconciler import llmservice_path


def engine_metrics(
    engine: EngineMetrics,
    *,
    running: int,
    waiting: int,
    kv: float,
    ttfts: tuple[float, ...] = (),
    finished: int | None = None,
) -> str:
    """An engine's /metrics with its own names (label ``model_name``, as both engines write);
    its request and token counters only when ``finished`` is given."""
    registry = CollectorRegistry()
    labels = {"model_name": "tiny"}
    for name, value in ((engine.running, running), (engine.waiting, waiting)):
        Gauge(name, name, list(labels), registry=registry).labels(**labels).set(value)
    Gauge(engine.kv_cache_usage, "kv", list(labels), registry=registry).labels(**labels).set(kv)
    counters = (
        ()
        if finished is None
        else (
            (engine.requests, finished),
            (engine.prompt_tokens, 10 * finished),
            (engine.generation_tokens, 5 * finished),
        )
    )
    for name, value in counters:
        counter = Counter(name.removesuffix("_total"), name, list(labels), registry=registry)
        counter.labels(**labels).inc(value)
    hist = Histogram(
        engine.ttft, "ttft", list(labels), buckets=(0.1, 0.5, 1, 2, 5), registry=registry
    ).labels(**labels)
    for value in ttfts:
        hist.observe(value)
    return generate_latest(registry).decode()


@pytest.mark.parametrize("engine", [VLLM, SGLANG], ids=["vllm", "sglang"])
async def test_engine_queue_scales_up_from_its_metrics_alone(engine: EngineMetrics) -> None:
    w = World()
    llmservice(w.kube, replicas=1)
    w.kube.objects[llmservice_path(NS, "tiny")]["spec"]["engine"] = engine.engine
    w.kube.slices = [
        endpoint_slice("tiny", 8000, ("tiny-a", "198.18.0.5", True)),
        endpoint_slice("conveyor-gateway", 8080, ("gw-a", "198.18.0.9", True)),
    ]
    w.scraper.pages = {
        "http://198.18.0.5:8000/metrics": engine_metrics(
            engine, running=8, waiting=7, kv=0.4, ttfts=(0.3,) * 12
        ),
        "http://198.18.0.9:8080/metrics": gateway_metrics(tiny=0),
    }
    decision = await w.timer.tick(NS, "tiny")
    assert decision is not None
    assert (decision.desired, decision.direction, decision.reason) == (4, "up", "queue-depth")
    status = w.kube.objects[llmservice_path(NS, "tiny")]["status"]["autoscaler"]
    assert status["signals"]["queueDepthPerReplica"] == 7.0
    assert status["signals"]["runningPerReplica"] == 8.0
    assert status["signals"]["kvCacheUsage"] == pytest.approx(0.4)
    assert status["signals"]["readyReplicas"] == 1


async def test_engine_ttft_and_counters_feed_the_same_signals() -> None:
    w = World()
    llmservice(w.kube, replicas=1, targetQueueDepthPerReplica=100)
    w.kube.objects[llmservice_path(NS, "tiny")]["spec"]["engine"] = "vllm"
    w.kube.slices = [
        endpoint_slice("tiny", 8000, ("tiny-a", "198.18.0.5", True)),
        endpoint_slice("conveyor-gateway", 8080),
    ]
    page = "http://198.18.0.5:8000/metrics"
    w.scraper.pages[page] = engine_metrics(VLLM, running=1, waiting=0, kv=0.1, finished=0)
    await w.timer.tick(NS, "tiny")
    w.clock.now += 2
    slow = (3.0,) * 20
    w.scraper.pages[page] = engine_metrics(
        VLLM, running=1, waiting=0, kv=0.1, ttfts=slow, finished=20
    )
    decision = await w.timer.tick(NS, "tiny")
    assert decision is not None and decision.direction == "up" and decision.reason == "ttft-p95"
    signals = w.kube.objects[llmservice_path(NS, "tiny")]["status"]["autoscaler"]["signals"]
    assert signals["ttftP95Seconds"] > 2
    # the counters demand and capacity are measured from, under vLLM's names
    scrape = await w.timer._scrape_replica(Endpoint("tiny-a", "http://198.18.0.5:8000"), VLLM)
    assert scrape.counters == (20.0, 300.0) and scrape.ready


@pytest.mark.parametrize("limit", [None, 4], ids=["engine-default", "maxRunningRequests-4"])
async def test_the_batch_an_engine_replica_was_given_is_its_llmservices(limit: int | None) -> None:
    """vLLM does not export ``--max-num-seqs``: the autoscaler reads the batch it gave the
    replica (``spec.runtime.maxRunningRequests``) rather than vLLM's default of 256, so eight
    running on a batch of four call for a second replica."""
    w = World()
    llmservice(w.kube, replicas=1, targetQueueDepthPerReplica=100)
    spec = w.kube.objects[llmservice_path(NS, "tiny")]["spec"]
    spec["engine"] = "vllm"
    if limit is not None:
        spec["runtime"] = {"maxRunningRequests": limit}
    w.kube.slices = [
        endpoint_slice("tiny", 8000, ("tiny-a", "198.18.0.5", True)),
        endpoint_slice("conveyor-gateway", 8080, ("gw-a", "198.18.0.9", True)),
    ]
    w.scraper.pages = {
        "http://198.18.0.5:8000/metrics": engine_metrics(VLLM, running=8, waiting=0, kv=0.1),
        "http://198.18.0.9:8080/metrics": gateway_metrics(tiny=0),
    }
    decision = await w.timer.tick(NS, "tiny")
    assert decision is not None
    if limit is None:
        assert (decision.desired, decision.direction) == (1, "none")
    else:
        assert (decision.desired, decision.direction, decision.reason) == (2, "up", "running")
