"""The autoscaler's timer: observe one LLMService, call ``decide``, write the result.

Each tick (a kopf timer per LLMService, ``--autoscale-interval``):

1. the ready replicas from the LLMService's EndpointSlices (ready endpoints, port ``http``);
2. each scraped directly and concurrently, with a per-replica timeout: ``GET /load`` (queue,
   running, KV usage, still loading?) and ``GET /metrics`` (the TTFT histogram, of which only
   the change over the last ``--autoscale-ttft-window`` seconds counts);
3. the namespace gateway's replicas (the ``conveyor-gateway`` Service's EndpointSlices),
   ``GET /metrics``, ``conveyor_gateway_pending_requests{model=...}`` summed over gateways:
   requests held because no replica is ready (scale from zero);
4. ``decide(observation, policy, history)``; a change of replicas is written through the scale
   subresource and posted as an Event; the decision and signals go to ``status.autoscaler``
   and to the ``conveyor_autoscaler_*`` metrics.

What is kept between ticks (decision history, recent TTFT histograms per replica) is keyed by
namespace/name and dropped when the LLMService is deleted or autoscaling is turned off.
The HTTP client and the Kubernetes client are the two boundaries; both are passed in.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
from prometheus_client.parser import text_string_to_metric_families

from conveyor.gateway.metrics import PENDING_REQUESTS
from conveyor.operator import signals
from conveyor.operator.autoscaler import (
    AutoscalingPolicy,
    Decision,
    History,
    Observation,
    ReplicaSignals,
    decide,
)
from conveyor.operator.kube import Kube
from conveyor.operator.metrics import OperatorMetrics
from conveyor.operator.names import GATEWAY_NAME, PORT_NAME
from conveyor.operator.reconciler import PostEvent, llmservice_path, now_rfc3339
from conveyor.operator.runtime_manifests import served_name

log = logging.getLogger("conveyor.operator.autoscaler")

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
"""Label the EndpointSlice controller puts on each slice of a Service."""

TTFT_QUANTILE = 0.95
TTFT_WINDOW_S = 30.0
"""Default span of the TTFT p95 signal: long enough that one slow request among a handful
does not read as a breach (which, decided on every tick, made replicas flap), short enough
to see a step of load within a few ticks."""
MIN_TTFT_OBSERVATIONS = 10
"""Fewer first tokens than this in the window give no TTFT signal (a p95 of 3 is noise)."""


def endpointslices_path(namespace: str) -> str:
    return f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"


# ---- pure parts: EndpointSlices, /load, /metrics -> an Observation -----------------------


@dataclass(frozen=True)
class Endpoint:
    """One ready endpoint of a Service: its pod (for per-replica history) and base URL."""

    key: str
    url: str


def ready_endpoints(slices: Iterable[dict[str, Any]], port_name: str) -> list[Endpoint]:
    """Ready endpoints of EndpointSlices (API JSON), at the port named ``port_name``.

    ``conditions.ready`` unset means ready (the API's convention); a terminating endpoint is
    never ready. The same address in several slices appears once.
    """
    found: dict[str, Endpoint] = {}
    for slice_ in slices:
        ports = [p for p in slice_.get("ports") or [] if p.get("name") == port_name]
        if not ports or ports[0].get("port") is None:
            continue
        port = int(ports[0]["port"])
        for endpoint in slice_.get("endpoints") or []:
            conditions = endpoint.get("conditions") or {}
            if conditions.get("ready") is False or conditions.get("terminating") is True:
                continue
            addresses = endpoint.get("addresses") or []
            if not addresses:
                continue
            host = addresses[0]
            url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
            pod = (endpoint.get("targetRef") or {}).get("name")
            found.setdefault(url, Endpoint(key=pod or url, url=url))
    return sorted(found.values(), key=lambda e: e.url)


def parse_load(text: str) -> tuple[ReplicaSignals, bool]:
    """A replica's ``/load`` JSON as (signals, ready); ValueError naming what is wrong."""
    doc = json.loads(text)
    if not isinstance(doc, dict):
        raise ValueError(f"/load must be a JSON object, got {type(doc).__name__}")
    try:
        replica = ReplicaSignals(
            waiting=int(doc["waiting"]),
            running=int(doc["running"]),
            max_running=max(1, int(doc["max_running_requests"])),
            kv_cache_usage=float(doc["kv_cache_usage"]),
        )
    except (KeyError, TypeError) as exc:
        raise ValueError(f"/load lacks or mistypes {exc}") from None
    return replica, doc.get("ready") is True


def pending_requests(text: str, model: str) -> int:
    """``conveyor_gateway_pending_requests{model=model}`` in one gateway's Prometheus text."""
    total = 0.0
    for family in text_string_to_metric_families(text):
        if family.name != PENDING_REQUESTS:
            continue
        for sample in family.samples:
            if sample.labels.get("model") == model:
                total += sample.value
    return int(total)


@dataclass(frozen=True)
class ReplicaScrape:
    """What one ready endpoint answered (None where the scrape failed)."""

    endpoint: Endpoint
    load: ReplicaSignals | None
    ready: bool
    ttft: signals.Buckets | None


@dataclass
class ServiceState:
    """What the timer keeps for one LLMService between ticks."""

    history: History = field(default_factory=History)
    ttft_seen: dict[str, deque[tuple[float, signals.Buckets]]] = field(default_factory=dict)
    """Replica key (pod) -> its TTFT histograms of the last window, oldest first."""
    last_scale_time: str | None = None


def build_observation(
    *,
    now: float,
    current_replicas: int,
    replicas: list[ReplicaScrape],
    pending: int,
    state: ServiceState,
    ttft_window: float = TTFT_WINDOW_S,
) -> Observation:
    """The Observation for ``decide``; records this tick's TTFT histograms in ``state``.

    A replica counts when it answered ``/load`` and says it is ready. TTFT p95 is over the
    first tokens of the last ``ttft_window`` seconds (each replica's histogram now minus its
    histogram at the window's start, or at its first scrape if younger), merged over every
    replica that answered ``/metrics``; None with fewer than ``MIN_TTFT_OBSERVATIONS``.
    Replicas gone since the previous tick are forgotten.
    """
    ready = tuple(r.load for r in replicas if r.load is not None and r.ready)
    deltas = []
    for r in replicas:
        if r.ttft is None:
            continue
        seen = state.ttft_seen.setdefault(r.endpoint.key, deque())
        if seen and signals.restarted(r.ttft, seen[-1][1]):
            seen.clear()  # counts went down: a new process, whose counts are all its own
            deltas.append(r.ttft)
        # the baseline: the last histogram at or before the window's start, else the oldest
        while len(seen) > 1 and seen[1][0] <= now - ttft_window:
            seen.popleft()
        if seen:
            deltas.append(signals.delta(r.ttft, seen[0][1]))
        seen.append((now, r.ttft))
    listed = {r.endpoint.key for r in replicas}
    for key in state.ttft_seen.keys() - listed:
        del state.ttft_seen[key]
    window = signals.merge(deltas)
    observed = max(window.values(), default=0.0)
    ttft = signals.quantile(TTFT_QUANTILE, window) if observed >= MIN_TTFT_OBSERVATIONS else None
    return Observation(
        time=now,
        current_replicas=current_replicas,
        ready=ready,
        ttft_p95=ttft,
        pending_requests=pending,
    )


def status_signals(obs: Observation) -> dict[str, Any]:
    """``status.autoscaler.signals`` (printer columns read two of them)."""
    n = obs.num_ready
    out: dict[str, Any] = {
        "readyReplicas": n,
        "queueDepthPerReplica": round(obs.waiting / n, 3) if n else 0.0,
        "runningPerReplica": round(obs.running / n, 3) if n else 0.0,
        "kvCacheUsage": round(sum(r.kv_cache_usage for r in obs.ready) / n, 4) if n else 0.0,
        "pendingRequests": obs.pending_requests,
    }
    if obs.ttft_p95 is not None:
        out["ttftP95Seconds"] = round(obs.ttft_p95, 4)
    return out


def autoscaler_status(
    obs: Observation, decision: Decision, *, now: str, last_scale_time: str | None
) -> dict[str, Any]:
    status: dict[str, Any] = {
        "lastDecisionTime": now,
        "desiredReplicas": decision.desired,
        "direction": decision.direction,
        "reason": decision.reason,
        "signals": status_signals(obs),
    }
    if last_scale_time is not None:
        status["lastScaleTime"] = last_scale_time
    return status


# ---- the boundaries ----------------------------------------------------------------------


class Scraper(Protocol):
    """HTTP GET of a replica's or gateway's text; raises ``httpx.HTTPError`` or ValueError."""

    async def get_text(self, url: str) -> str: ...


class HttpScraper:
    """The real :class:`Scraper`: one pooled httpx client, a timeout per request, no proxies."""

    def __init__(self, timeout_s: float) -> None:
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s),
            limits=httpx.Limits(max_keepalive_connections=64),
            trust_env=False,  # a proxy variable must not reroute traffic meant for pods
        )

    async def get_text(self, url: str) -> str:
        response = await self._client.get(url)
        response.raise_for_status()
        return response.text

    async def close(self) -> None:
        await self._client.aclose()


# ---- the timer ---------------------------------------------------------------------------


SIGNAL_NAMES = ("queue_depth_per_replica", "ttft_p95_seconds", "kv_cache_usage")


class AutoscalerTimer:
    """One tick per LLMService per interval; state per LLMService keyed by (namespace, name)."""

    def __init__(
        self,
        *,
        kube: Kube,
        scraper: Scraper,
        metrics: OperatorMetrics,
        post_event: PostEvent,
        clock: Callable[[], float] = time.monotonic,
        ttft_window: float = TTFT_WINDOW_S,
    ) -> None:
        self.kube = kube
        self.ttft_window = ttft_window
        self.scraper = scraper
        self.metrics = metrics
        self.post_event = post_event
        self.clock = clock
        self._states: dict[tuple[str, str], ServiceState] = {}

    def forget(self, namespace: str, name: str) -> None:
        """Drop a deleted (or no longer autoscaled) LLMService's history and metric series."""
        if self._states.pop((namespace, name), None) is not None:
            self.metrics.forget_llmservice(namespace, name)

    @property
    def tracked(self) -> set[tuple[str, str]]:
        return set(self._states)

    async def tick(self, namespace: str, name: str) -> Decision | None:
        """One decision for one LLMService; None when it is gone or not autoscaled."""
        llmservice = await self.kube.get(llmservice_path(namespace, name))
        if llmservice is None or llmservice["metadata"].get("deletionTimestamp"):
            self.forget(namespace, name)
            return None
        spec = llmservice.get("spec") or {}
        policy = AutoscalingPolicy.from_spec(spec.get("autoscaling"))
        if not policy.enabled:
            self.forget(namespace, name)
            return None
        state = self._states.setdefault((namespace, name), ServiceState())
        model = served_name(llmservice)
        runtime, gateways = await asyncio.gather(
            self._endpoints(namespace, name), self._endpoints(namespace, GATEWAY_NAME)
        )
        replicas, pending = await asyncio.gather(
            asyncio.gather(*(self._scrape_replica(e) for e in runtime)),
            self._pending(gateways, model),
        )
        current = int(spec.get("replicas", policy.min_replicas))
        obs = build_observation(
            now=self.clock(),
            current_replicas=current,
            replicas=list(replicas),
            pending=pending,
            state=state,
            ttft_window=self.ttft_window,
        )
        decision = decide(obs, policy, state.history)
        if decision.desired != current:
            await self.kube.merge_patch(
                f"{llmservice_path(namespace, name)}/scale",
                {"spec": {"replicas": decision.desired}},
            )
            state.last_scale_time = now_rfc3339()
            message = (
                f"scaled {decision.direction} from {current} to {decision.desired} replicas: "
                f"{decision.reason} ({_describe(obs, policy)})"
            )
            log.info("%s/%s: %s", namespace, name, message)
            event = "ScaledUp" if decision.desired > current else "ScaledDown"
            self.post_event(llmservice, "Normal", event, message)
        await self._patch_status(llmservice, obs, decision, state)
        self._record_metrics(namespace, name, obs, policy, decision)
        return decision

    async def _endpoints(self, namespace: str, service: str) -> list[Endpoint]:
        slices = await self.kube.list(
            endpointslices_path(namespace), label_selector=f"{SERVICE_NAME_LABEL}={service}"
        )
        return ready_endpoints(slices, PORT_NAME)

    async def _scrape_replica(self, endpoint: Endpoint) -> ReplicaScrape:
        load_text, metrics_text = await asyncio.gather(
            self.scraper.get_text(f"{endpoint.url}/load"),
            self.scraper.get_text(f"{endpoint.url}/metrics"),
            return_exceptions=True,
        )
        load, ready, ttft = None, False, None
        if isinstance(load_text, str):
            try:
                load, ready = parse_load(load_text)
            except ValueError as exc:
                log.warning("replica %s: bad /load: %s", endpoint.url, exc)
        elif isinstance(load_text, (httpx.HTTPError, OSError)):
            log.info("replica %s: /load not answered: %s", endpoint.url, _error(load_text))
        else:
            raise load_text
        if isinstance(metrics_text, str):
            try:
                ttft = signals.parse_histogram(metrics_text)
            except ValueError as exc:
                log.warning("replica %s: bad /metrics: %s", endpoint.url, exc)
        elif isinstance(metrics_text, (httpx.HTTPError, OSError)):
            log.info("replica %s: /metrics not answered: %s", endpoint.url, _error(metrics_text))
        else:
            raise metrics_text
        return ReplicaScrape(endpoint, load, ready, ttft)

    async def _pending(self, gateways: list[Endpoint], model: str) -> int:
        """Requests for ``model`` held by the namespace's gateways, summed over gateway replicas."""
        texts = await asyncio.gather(
            *(self.scraper.get_text(f"{g.url}/metrics") for g in gateways), return_exceptions=True
        )
        total = 0
        for gateway, text in zip(gateways, texts, strict=True):
            if isinstance(text, str):
                try:
                    total += pending_requests(text, model)
                except ValueError as exc:
                    log.warning("gateway %s: bad /metrics: %s", gateway.url, exc)
            elif isinstance(text, (httpx.HTTPError, OSError)):
                log.info("gateway %s: /metrics not answered: %s", gateway.url, _error(text))
            else:
                raise text
        return total

    async def _patch_status(
        self, llmservice: dict[str, Any], obs: Observation, decision: Decision, state: ServiceState
    ) -> None:
        meta = llmservice["metadata"]
        status = autoscaler_status(
            obs, decision, now=now_rfc3339(), last_scale_time=state.last_scale_time
        )
        old = (llmservice.get("status") or {}).get("autoscaler") or {}
        if _without_time(old) == _without_time(status):
            return  # nothing new to say: spare the apiserver a write per tick
        path = f"{llmservice_path(meta['namespace'], meta['name'])}/status"
        patch = {**status, "signals": {"ttftP95Seconds": None, **status["signals"]}}
        await self.kube.merge_patch(path, {"status": {"autoscaler": patch}})  # null removes

    def _record_metrics(
        self,
        namespace: str,
        name: str,
        obs: Observation,
        policy: AutoscalingPolicy,
        decision: Decision,
    ) -> None:
        m, labels = self.metrics, (namespace, name)
        m.autoscaler_desired.labels(*labels).set(decision.desired)
        m.autoscaler_ready.labels(*labels).set(obs.num_ready)
        m.autoscaler_min.labels(*labels).set(policy.min_replicas)
        m.autoscaler_max.labels(*labels).set(policy.max_replicas)
        n = obs.num_ready
        values = {
            "queue_depth_per_replica": obs.waiting / n if n else 0.0,
            "ttft_p95_seconds": obs.ttft_p95,
            "kv_cache_usage": sum(r.kv_cache_usage for r in obs.ready) / n if n else 0.0,
        }
        targets = {
            "queue_depth_per_replica": policy.target_queue_depth,
            "ttft_p95_seconds": policy.target_ttft_p95,
            "kv_cache_usage": policy.target_kv_cache_usage,
        }
        for signal in SIGNAL_NAMES:
            value, target = values[signal], targets[signal]
            m.autoscaler_signal.labels(*labels, signal).set(math.nan if value is None else value)
            if target is not None:
                m.autoscaler_target.labels(*labels, signal).set(target)
        m.autoscaler_decisions.labels(*labels, decision.direction, decision.reason).inc()


def _describe(obs: Observation, policy: AutoscalingPolicy) -> str:
    n = obs.num_ready
    parts = [
        f"{n} ready",
        f"queue {obs.waiting / n if n else 0:.1f}/replica (target {policy.target_queue_depth:g})",
    ]
    if obs.ttft_p95 is not None:
        target = "none" if policy.target_ttft_p95 is None else f"{policy.target_ttft_p95:g}s"
        parts.append(f"TTFT p95 {obs.ttft_p95:.2f}s (target {target})")
    if obs.pending_requests:
        parts.append(f"{obs.pending_requests} held at the gateway")
    return ", ".join(parts)


def _without_time(status: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in status.items() if k != "lastDecisionTime"}


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
