"""The autoscaler's timer: EndpointSlices, /load and /metrics in, scale, status, Events and
metrics out. Faked at the operator's own boundaries only (the Kube calls and the Scraper);
anything not prepared fails loudly."""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from conveyor.operator.autoscaler_model import History, Rates, ReplicaSignals
from conveyor.operator.autoscaler_observe import (
    Endpoint,
    ReplicaScrape,
    ServiceState,
    build_observation,
    endpointslices_path,
    parse_load,
    pending_requests,
    ready_endpoints,
)
from conveyor.operator.autoscaler_timer import AutoscalerTimer
from conveyor.operator.crd import apply_defaults
from conveyor.operator.metrics import OperatorMetrics
from conveyor.operator.reconciler import llmservice_path
from conveyor.runtime.metrics_names import (
    GENERATION_TOKENS,
    PROMPT_TOKENS,
    REQUEST_SUCCESS,
    TIME_TO_FIRST_TOKEN,
)

NS = "team"
BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


# ---- fakes at the boundaries -------------------------------------------------------------


class FakeKube:
    """get / list (by ``kubernetes.io/service-name``) / merge_patch, as ``Kube`` offers them."""

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.slices: list[dict[str, Any]] = []
        self.patches: list[tuple[str, dict[str, Any]]] = []

    async def get(self, path: str) -> dict[str, Any] | None:
        obj = self.objects.get(path)
        return copy.deepcopy(obj) if obj is not None else None

    async def list(self, path: str, *, label_selector: str | None = None) -> list[dict[str, Any]]:
        assert path == endpointslices_path(NS), path
        key, _, service = (label_selector or "").partition("=")
        assert key == "kubernetes.io/service-name", label_selector
        return [
            copy.deepcopy(s)
            for s in self.slices
            if s["metadata"]["labels"]["kubernetes.io/service-name"] == service
        ]

    async def merge_patch(self, path: str, patch: dict[str, Any]) -> dict[str, Any]:
        self.patches.append((path, copy.deepcopy(patch)))
        base = path.removesuffix("/scale").removesuffix("/status")
        obj = self.objects[base]
        if path.endswith("/scale"):
            obj["spec"]["replicas"] = patch["spec"]["replicas"]
        elif path.endswith("/status"):
            auto = obj.setdefault("status", {}).setdefault("autoscaler", {})
            signals = {**auto.get("signals", {}), **patch["status"]["autoscaler"]["signals"]}
            auto.update(patch["status"]["autoscaler"])
            auto["signals"] = {k: v for k, v in signals.items() if v is not None}
        else:
            raise AssertionError(f"unexpected patch of {path}")
        return copy.deepcopy(obj)

    def scales(self) -> list[int]:
        return [p["spec"]["replicas"] for path, p in self.patches if path.endswith("/scale")]


class FakeScraper:
    """URL -> text (or an exception to raise); an unknown URL fails the test."""

    def __init__(self) -> None:
        self.pages: dict[str, str | Exception] = {}

    async def get_text(self, url: str) -> str:
        if url not in self.pages:
            raise AssertionError(f"unexpected scrape of {url}")
        page = self.pages[url]
        if isinstance(page, Exception):
            raise page
        return page


def endpoint_slice(service: str, port: int, *endpoints: tuple[str, str, bool | None]) -> dict:
    """A slice of ``service`` with (pod, address, ready) endpoints; ready None leaves it unset."""
    return {
        "metadata": {"name": f"{service}-x", "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
        "endpoints": [
            {
                "addresses": [address],
                "conditions": {} if ready is None else {"ready": ready},
                "targetRef": {"kind": "Pod", "name": pod},
            }
            for pod, address, ready in endpoints
        ],
    }


def load(waiting: int = 0, running: int = 0, kv: float = 0.0, ready: bool = True) -> str:
    return json.dumps({
        "running": running, "waiting": waiting, "kv_cache_usage": kv,
        "max_running_requests": 8, "max_queued_requests": None, "ready": ready,
    })  # fmt: skip


def ttft_metrics(*observations: float) -> str:
    """A runtime's /metrics with ``observations`` in its TTFT histogram (as the runtime writes it)."""
    registry = CollectorRegistry()
    hist = Histogram(
        TIME_TO_FIRST_TOKEN, "TTFT", ["model"], buckets=BUCKETS, registry=registry
    ).labels("tiny")
    for value in observations:
        hist.observe(value)
    return generate_latest(registry).decode()


def gateway_metrics(**pending: int) -> str:
    registry = CollectorRegistry()
    gauge = Gauge("conveyor_gateway_pending_requests", "held", ["model"], registry=registry)
    for model, count in pending.items():
        gauge.labels(model).set(count)
    return generate_latest(registry).decode()


def llmservice(kube: FakeKube, replicas: int, **autoscaling: Any) -> None:
    body = apply_defaults({
        "apiVersion": "conveyor.dev/v1alpha1",
        "kind": "LLMService",
        "metadata": {"name": "tiny", "namespace": NS, "uid": "u1"},
        "spec": {
            "model": {"builtin": "conveyor-tiny"},
            "replicas": replicas,
            "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 4,
                            "targetQueueDepthPerReplica": 2, "targetTTFTP95Seconds": 1.0,
                            "scaleDownStabilizationSeconds": 10, **autoscaling},
        },
    })  # fmt: skip
    kube.objects[llmservice_path(NS, "tiny")] = body


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class World:
    kube: FakeKube = field(default_factory=FakeKube)
    scraper: FakeScraper = field(default_factory=FakeScraper)
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)
    events: list[tuple[str, str, str]] = field(default_factory=list)
    clock: Clock = field(default_factory=Clock)

    def __post_init__(self) -> None:
        self.timer = AutoscalerTimer(
            kube=self.kube,  # type: ignore[arg-type]
            scraper=self.scraper,
            metrics=self.metrics,
            post_event=lambda obj, kind, reason, msg: self.events.append((kind, reason, msg)),
            clock=self.clock,
        )


@pytest.fixture
def world() -> World:
    return World()


def sample(metrics: OperatorMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(
        name, {"namespace": NS, "llmservice": "tiny", **labels}
    )


# ---- pure parts --------------------------------------------------------------------------


def test_ready_endpoints_skip_unready_and_terminating_and_use_the_named_port():
    slices = [
        endpoint_slice("tiny", 8000, ("p1", "198.18.0.5", True), ("p2", "198.18.0.6", False)),
        endpoint_slice("tiny", 8000, ("p3", "198.18.0.7", None), ("p1", "198.18.0.5", True)),
        {"metadata": {}, "ports": [{"name": "metrics", "port": 9}], "endpoints": []},
    ]
    slices[1]["endpoints"].append(
        {"addresses": ["198.18.0.8"], "conditions": {"ready": True, "terminating": True}}
    )
    assert ready_endpoints(slices, "http") == [
        Endpoint("p1", "http://198.18.0.5:8000"),
        Endpoint("p3", "http://198.18.0.7:8000"),
    ]


def test_load_and_pending_parsing():
    signals, ready = parse_load(load(waiting=3, running=2, kv=0.5))
    assert (signals, ready) == (ReplicaSignals(3, 2, 8, 0.5), True)
    assert parse_load(load(ready=False))[1] is False
    with pytest.raises(ValueError, match="waiting"):
        parse_load('{"running": 1}')
    assert pending_requests(gateway_metrics(tiny=3, other=5), "tiny") == 3
    assert pending_requests(gateway_metrics(other=5), "tiny") == 0


def test_ttft_p95_is_over_the_window_not_lifetime_totals():
    state = ServiceState(history=History())
    one = Endpoint("p1", "http://a:8000")
    ok = [ReplicaSignals(0, 1, 8, 0.1)]
    counts = {"fast": 0, "slow": 0}

    def observe(now: float, fast: int = 0, slow: int = 0):
        counts["fast"] += fast
        counts["slow"] += slow
        ttfts = [0.07] * counts["fast"] + [3.0] * counts["slow"]
        scrape = ReplicaScrape(one, ok[0], True, _buckets(ttft_metrics(*ttfts)))
        return build_observation(
            now=now, current_replicas=1, replicas=[scrape], pending=0, state=state, ttft_window=30
        )

    assert observe(0, fast=100).ttft_p95 is None  # first scrape: a baseline, not a window
    # 100 fast then 50 slow within the window: p95 among 150, not among the lifetime 250
    assert observe(10, fast=100).ttft_p95 == pytest.approx(0.0975, abs=0.01)
    obs = observe(20, slow=50)
    assert obs.ttft_p95 is not None and obs.ttft_p95 > 2.5
    # one slow first token among few is not a signal
    assert observe(60, slow=1).ttft_p95 is None
    # the slow ones age out of the window: only the fast ones since count
    assert observe(85, fast=40).ttft_p95 == pytest.approx(0.0975, abs=0.01)
    # nothing new over a whole window: no TTFT (not the lifetime p95)
    observe(120)
    assert observe(151).ttft_p95 is None
    # the replica restarted (counts went down): its new counts are its own window
    counts.update(fast=0, slow=0)
    assert observe(152, fast=12).ttft_p95 == pytest.approx(0.0975, abs=0.01)


def test_loading_or_silent_replicas_are_not_counted_as_ready():
    state = ServiceState()
    scrapes = [
        ReplicaScrape(Endpoint("p1", "u1"), ReplicaSignals(4, 8, 8, 0.3), True, None),
        ReplicaScrape(Endpoint("p2", "u2"), ReplicaSignals(0, 0, 8, 0.0), False, None),
        ReplicaScrape(Endpoint("p3", "u3"), None, False, None),
    ]
    obs = build_observation(now=0, current_replicas=3, replicas=scrapes, pending=2, state=state)
    assert obs.num_ready == 1 and obs.waiting == 4 and obs.pending_requests == 2


def _buckets(text: str):
    from conveyor.operator.signals import parse_histogram

    return parse_histogram(text)


# ---- the tick ----------------------------------------------------------------------------


async def test_queue_builds_up_scales_in_one_step_with_status_event_and_metrics(world):
    w = world
    kube, scraper, metrics, events, clock, timer = (
        w.kube,
        w.scraper,
        w.metrics,
        w.events,
        w.clock,
        w.timer,
    )
    llmservice(kube, replicas=1)
    kube.slices = [
        endpoint_slice("tiny", 8000, ("tiny-a", "198.18.0.5", True)),
        endpoint_slice("conveyor-gateway", 8080, ("gw-a", "198.18.0.9", True)),
    ]
    scraper.pages = {
        "http://198.18.0.5:8000/load": load(waiting=7, running=8, kv=0.4),
        "http://198.18.0.5:8000/metrics": ttft_metrics(0.07),
        "http://198.18.0.9:8080/metrics": gateway_metrics(tiny=0),
    }
    decision = await timer.tick(NS, "tiny")
    assert decision is not None
    assert (decision.desired, decision.direction, decision.reason) == (4, "up", "queue-depth")
    assert kube.scales() == [4]
    status = kube.objects[llmservice_path(NS, "tiny")]["status"]["autoscaler"]
    assert status["desiredReplicas"] == 4 and status["reason"] == "queue-depth"
    assert status["signals"]["queueDepthPerReplica"] == 7.0
    assert status["signals"]["readyReplicas"] == 1 and "ttftP95Seconds" not in status["signals"]
    assert status["lastScaleTime"]
    assert [(k, r) for k, r, _ in events] == [("Normal", "ScaledUp")]
    assert "from 1 to 4" in events[0][2]
    assert sample(metrics, "conveyor_autoscaler_desired_replicas") == 4
    assert sample(metrics, "conveyor_autoscaler_ready_replicas") == 1
    assert sample(metrics, "conveyor_autoscaler_max_replicas") == 4
    assert sample(metrics, "conveyor_autoscaler_signal", signal="queue_depth_per_replica") == 7
    assert sample(metrics, "conveyor_autoscaler_target", signal="queue_depth_per_replica") == 2
    assert sample(metrics, "conveyor_autoscaler_target", signal="ttft_p95_seconds") == 1.0
    up = {"direction": "up", "reason": "queue-depth"}
    assert sample(metrics, "conveyor_autoscaler_decisions_total", **up) == 1

    # New replicas still loading (not in the ready endpoints): no further change, no event.
    clock.now += 2
    decision = await timer.tick(NS, "tiny")
    assert decision is not None and decision.direction == "none"
    assert kube.scales() == [4] and len(events) == 1


async def test_scale_down_after_the_window_and_a_silent_replica_does_not_freeze_it(world):
    w = world
    kube, scraper, events, clock, timer = w.kube, w.scraper, w.events, w.clock, w.timer
    llmservice(kube, replicas=3)
    kube.slices = [
        endpoint_slice(
            "tiny", 8000, ("a", "198.18.0.5", True), ("b", "198.18.0.6", True),
            ("c", "198.18.0.7", True),
        ),
        endpoint_slice("conveyor-gateway", 8080),
    ]  # fmt: skip
    for host in ("198.18.0.5", "198.18.0.6"):
        scraper.pages[f"http://{host}:8000/load"] = load()
        scraper.pages[f"http://{host}:8000/metrics"] = ttft_metrics()
    timeout = httpx.ConnectTimeout("no answer")
    scraper.pages["http://198.18.0.7:8000/load"] = timeout
    scraper.pages["http://198.18.0.7:8000/metrics"] = timeout
    decisions = []
    for _ in range(10):
        decisions.append(await timer.tick(NS, "tiny"))
        clock.now += 2
    assert kube.scales() == [1]  # after the 10 s window, not before; to min in one step (2 max)
    assert [d.direction for d in decisions].count("down") == 1
    assert decisions[0].direction == "none"
    assert events[-1][1] == "ScaledDown"


async def test_scale_from_zero_on_requests_held_by_any_gateway(world):
    w = world
    kube, scraper, clock, timer = w.kube, w.scraper, w.clock, w.timer
    llmservice(kube, replicas=0, minReplicas=0)
    kube.slices = [
        endpoint_slice("tiny", 8000),
        endpoint_slice(
            "conveyor-gateway", 8080, ("gw-a", "198.18.0.9", True), ("gw-b", "198.18.0.10", True)
        ),
    ]
    scraper.pages = {
        "http://198.18.0.9:8080/metrics": gateway_metrics(other=4),
        "http://198.18.0.10:8080/metrics": gateway_metrics(other=1),
    }
    decision = await timer.tick(NS, "tiny")
    assert decision is not None and (decision.desired, decision.reason) == (0, "scaled-to-zero")
    scraper.pages["http://198.18.0.10:8080/metrics"] = gateway_metrics(tiny=1)
    clock.now += 2
    decision = await timer.tick(NS, "tiny")
    assert decision is not None
    assert (decision.desired, decision.direction, decision.reason) == (1, "up", "pending-requests")
    assert kube.scales() == [1]
    status = kube.objects[llmservice_path(NS, "tiny")]["status"]["autoscaler"]
    assert status["signals"]["pendingRequests"] == 1


async def test_delete_and_disable_drop_the_state_and_series(world):
    w = world
    kube, metrics, timer = w.kube, w.metrics, w.timer
    llmservice(kube, replicas=1)
    kube.slices = [endpoint_slice("tiny", 8000), endpoint_slice("conveyor-gateway", 8080)]
    await timer.tick(NS, "tiny")
    assert timer.tracked == {(NS, "tiny")}
    assert sample(metrics, "conveyor_autoscaler_min_replicas") == 1
    kube.objects[llmservice_path(NS, "tiny")]["spec"]["autoscaling"]["enabled"] = False
    assert await timer.tick(NS, "tiny") is None
    assert timer.tracked == set()
    assert sample(metrics, "conveyor_autoscaler_min_replicas") is None
    assert sample(metrics, "conveyor_autoscaler_decisions_total", direction="none",
                  reason="no-ready-replica") is None  # fmt: skip
    del kube.objects[llmservice_path(NS, "tiny")]
    assert await timer.tick(NS, "tiny") is None


# ---- the kopf timer ----------------------------------------------------------------------


async def test_the_kopf_timer_runs_at_the_interval_setting_and_only_when_enabled(world):
    import kopf

    from conveyor.operator.handlers import register
    from conveyor.operator.settings import OperatorSettings

    registry = kopf.OperatorRegistry()
    register(
        registry,
        reconciler=object(),  # type: ignore[arg-type]  # not reached by the timer
        settings=OperatorSettings(autoscale_interval_s=3),
        autoscaler=world.timer,
    )
    timers = {h.id: h for h in registry._spawning.get_all_handlers()}
    assert timers["autoscale"].interval == 3
    llmservice(world.kube, replicas=1)
    world.kube.slices = [endpoint_slice("tiny", 8000), endpoint_slice("conveyor-gateway", 8080)]
    run = timers["autoscale"].fn
    spec = world.kube.objects[llmservice_path(NS, "tiny")]["spec"]
    await run(namespace=NS, name="tiny", spec=spec)
    assert world.timer.tracked == {(NS, "tiny")}
    await run(namespace=NS, name="tiny", spec={**spec, "autoscaling": {"enabled": False}})
    assert world.timer.tracked == set()  # turned off: state dropped, nothing scraped


# ---- demand and capacity -----------------------------------------------------------------


def runtime_metrics(finished: int, tokens: int, *ttfts: float) -> str:
    """A runtime's /metrics with its request and token counters and TTFT histogram."""
    registry = CollectorRegistry()
    Counter(REQUEST_SUCCESS.removesuffix("_total"), "done", ["model", "finish_reason"],
            registry=registry).labels("tiny", "stop").inc(finished)  # fmt: skip
    Counter(PROMPT_TOKENS.removesuffix("_total"), "p", ["model"], registry=registry).labels(
        "tiny"
    ).inc(tokens // 4)
    Counter(GENERATION_TOKENS.removesuffix("_total"), "g", ["model"], registry=registry).labels(
        "tiny"
    ).inc(tokens - tokens // 4)
    hist = Histogram(
        TIME_TO_FIRST_TOKEN, "TTFT", ["model"], buckets=BUCKETS, registry=registry
    ).labels("tiny")
    for value in ttfts:
        hist.observe(value)
    return generate_latest(registry).decode()


def test_counters_are_read_from_the_runtime_and_gateway_metrics():
    from conveyor.gateway.metrics import GatewayMetrics
    from conveyor.operator.signals import parse_counters, parse_rejected

    assert parse_counters(runtime_metrics(12, 1000)) == (12.0, 1000.0)
    assert parse_counters(ttft_metrics(0.1)) is None  # another engine: no demand from it
    registry = CollectorRegistry()  # a replica that finished nothing yet: declared, no sample
    Counter(REQUEST_SUCCESS.removesuffix("_total"), "done", ["model", "finish_reason"],
            registry=registry)  # fmt: skip
    assert parse_counters(generate_latest(registry).decode()) == (0.0, 0.0)
    gateway = GatewayMetrics()
    gateway.requests.labels("tiny", "", "429").inc(3)
    gateway.requests.labels("tiny", "http://a:8000", "503").inc(2)
    gateway.requests.labels("tiny", "http://a:8000", "200").inc(50)
    gateway.requests.labels("other", "", "429").inc(7)
    assert parse_rejected(generate_latest(gateway.registry).decode(), "tiny") == 5.0


async def test_demand_capacity_and_utilization_in_status_and_metrics_and_remembered(world):
    w = world
    kube, scraper, metrics, clock, timer = w.kube, w.scraper, w.metrics, w.clock, w.timer
    llmservice(kube, replicas=1)
    kube.slices = [
        endpoint_slice("tiny", 8000, ("tiny-a", "198.18.0.5", True)),
        endpoint_slice("conveyor-gateway", 8080, ("gw-a", "198.18.0.9", True)),
    ]
    scraper.pages["http://198.18.0.9:8080/metrics"] = gateway_metrics(tiny=0)
    # One replica with a queue throughout, finishing 8 requests (800 tokens) a second.
    decisions = []
    for tick in range(6):
        scraper.pages["http://198.18.0.5:8000/load"] = load(waiting=1, running=8, kv=0.5)
        scraper.pages["http://198.18.0.5:8000/metrics"] = runtime_metrics(16 * tick, 1600 * tick)
        decisions.append(await timer.tick(NS, "tiny"))
        clock.now += 2
    first = decisions[0]
    assert first is not None and first.estimate is None  # no window yet: the next tick
    assert (first.direction, first.reason) == ("none", "measuring-demand")
    last = decisions[-1]
    assert last is not None and last.estimate is not None
    assert (last.desired, last.direction) == (1, "none")
    status = kube.objects[llmservice_path(NS, "tiny")]["status"]["autoscaler"]
    sig = status["signals"]
    assert sig["demandRequestsPerSecond"] == pytest.approx(8.0)
    assert sig["demandTokensPerSecond"] == pytest.approx(800.0)
    assert sig["utilization"] == pytest.approx(1.0) and sig["panic"] is False
    assert sig["replicasNeeded"] == pytest.approx(1.0 + 1 / (30 * 8), abs=1e-3)
    capacity = status["capacity"]
    assert (capacity["requestsPerSecond"], capacity["tokensPerSecond"], capacity["source"]) == (
        8.0,
        800.0,
        "measured",
    )
    assert capacity["lastMeasuredTime"]

    def signal(name: str) -> float | None:
        return sample(metrics, "conveyor_autoscaler_signal", signal=name)

    assert signal("demand_requests_per_second") == pytest.approx(8.0)
    assert signal("capacity_requests_per_second") == pytest.approx(8.0)
    assert signal("capacity_tokens_per_second") == pytest.approx(800.0)
    assert signal("utilization") == pytest.approx(1.0)
    assert sample(metrics, "conveyor_autoscaler_target", signal="utilization") == 1.0

    # An operator restart: a new timer reads the capacity back from status.
    again = World(kube=kube, scraper=scraper, clock=clock)
    for tick in range(6, 8):
        scraper.pages["http://198.18.0.5:8000/metrics"] = runtime_metrics(16 * tick, 1600 * tick)
        decision = await again.timer.tick(NS, "tiny")
        clock.now += 2
    assert decision is not None and decision.estimate is not None
    assert decision.estimate.capacity_source == "status"
    assert decision.estimate.capacity == Rates(8.0, 800.0)


async def test_a_replica_without_counters_gives_no_demand(world):
    w = world
    llmservice(w.kube, replicas=1)
    w.kube.slices = [
        endpoint_slice("tiny", 8000, ("tiny-a", "198.18.0.5", True)),
        endpoint_slice("conveyor-gateway", 8080),
    ]
    w.scraper.pages["http://198.18.0.5:8000/load"] = load(waiting=1, running=1)
    w.scraper.pages["http://198.18.0.5:8000/metrics"] = ttft_metrics()
    for _ in range(4):
        decision = await w.timer.tick(NS, "tiny")
        w.clock.now += 2
    assert decision is not None and decision.estimate is None
    status = w.kube.objects[llmservice_path(NS, "tiny")]["status"]["autoscaler"]
    assert "demandRequestsPerSecond" not in status["signals"] and "capacity" not in status
    assert math.isnan(sample(w.metrics, "conveyor_autoscaler_signal", signal="utilization"))
