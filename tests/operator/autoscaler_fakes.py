"""The autoscaler timer's world, faked at the operator's own boundaries only (the Kube calls
and the Scraper; anything not prepared fails loudly), and the pages replicas and gateways
serve it: EndpointSlices, /load, and /metrics as the runtime and the gateway write them."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from conveyor.operator.autoscaler_observe import endpointslices_path, pods_path
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


class FakeKube:
    """get / list (EndpointSlices by ``kubernetes.io/service-name``, pods by their labels) /
    merge_patch, as ``Kube`` offers them; ``pods`` may be an exception to raise."""

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.slices: list[dict[str, Any]] = []
        self.pods: list[dict[str, Any]] | Exception = []
        self.patches: list[tuple[str, dict[str, Any]]] = []

    async def get(self, path: str) -> dict[str, Any] | None:
        obj = self.objects.get(path)
        return copy.deepcopy(obj) if obj is not None else None

    async def list(self, path: str, *, label_selector: str | None = None) -> list[dict[str, Any]]:
        if path == pods_path(NS):
            if isinstance(self.pods, Exception):
                raise self.pods
            wanted = dict(kv.split("=") for kv in (label_selector or "").split(","))
            return [
                copy.deepcopy(p)
                for p in self.pods
                if wanted.items() <= p["metadata"].get("labels", {}).items()
            ]
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
    return _with_ttft(CollectorRegistry(), observations)


def _with_ttft(registry: CollectorRegistry, observations: tuple[float, ...]) -> str:
    """``registry``'s text once ``observations`` are in its TTFT histogram."""
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


def sample(metrics: OperatorMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(
        name, {"namespace": NS, "llmservice": "tiny", **labels}
    )


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
    return _with_ttft(registry, ttfts)
