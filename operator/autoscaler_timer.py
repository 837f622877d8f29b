"""The autoscaler's timer: observe one LLMService, call ``decide``, write the result.

Each tick (a kopf timer per LLMService, ``--autoscale-interval``):

1. the ready replicas from the LLMService's EndpointSlices (ready endpoints, port ``http``);
2. each scraped directly and concurrently, with a per-replica timeout: ``GET /load`` (queue,
   running, KV usage, still loading?) and ``GET /metrics`` (the TTFT histogram, of which only
   the change over the last ``--autoscale-ttft-window`` seconds counts; the finished-request
   and token counters, whose change over the LLMService's demand and panic windows, with the
   backlog's, gives demand and, from replicas that had a queue throughout, capacity);
3. the namespace gateway's replicas (the ``conveyor-gateway`` Service's EndpointSlices),
   ``GET /metrics``, ``conveyor_gateway_pending_requests{model=...}`` summed over gateways:
   requests held because no replica is ready (scale from zero); and each gateway's count of
   requests for the model it answered 429 or 503 (demand that no replica took);
4. ``decide(observation, policy, history)``; a change of replicas is written through the scale
   subresource and posted as an Event; the decision and signals go to ``status.autoscaler``
   and to the ``conveyor_autoscaler_*`` metrics.

What is kept between ticks (decision history, recent TTFT histograms and counters per
replica, the backlog) is keyed by namespace/name and dropped when the LLMService is deleted or
autoscaling is turned off. The capacity estimate is also written to ``status.autoscaler.capacity``
and read back from there when the operator starts, so a restart does not forget it.
The HTTP client and the Kubernetes client are the two boundaries; both are passed in.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
from prometheus_client.parser import text_string_to_metric_families

from conveyor.gateway.metrics import PENDING_REQUESTS
from conveyor.operator import signals
from conveyor.operator.autoscaler import (
    AutoscalingPolicy,
    Decision,
    Demand,
    History,
    Observation,
    Rates,
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
    counters: tuple[float, float] | None = None
    """(finished requests, prompt + generated tokens) so far; None: not exposed or not read."""


@dataclass
class ServiceState:
    """What the timer keeps for one LLMService between ticks."""

    history: History = field(default_factory=History)
    ttft_seen: dict[str, deque[tuple[float, signals.Buckets]]] = field(default_factory=dict)
    """Replica key (pod) -> its TTFT histograms of the last window, oldest first."""
    counters_seen: dict[str, deque[signals.Counters]] = field(default_factory=dict)
    """Replica key (pod) -> its counters of the last demand window, oldest first (a replica
    gone within the window stays until its last scrape is older than the window)."""
    backlog_seen: deque[signals.Backlog] = field(default_factory=deque)
    """The service's backlog at each tick of the last demand window."""
    rejected_seen: dict[str, deque[signals.Counters]] = field(default_factory=dict)
    """Gateway key (pod) -> its count of requests turned away, over the last demand window."""
    last_scale_time: str | None = None
    capacity_time: str | None = None
    """When the capacity was last measured (RFC 3339, for status)."""

    @classmethod
    def from_status(cls, status: dict[str, Any] | None) -> ServiceState:
        """A fresh state that remembers the capacity the LLMService's status recorded."""
        state = cls()
        capacity = ((status or {}).get("autoscaler") or {}).get("capacity") or {}
        requests = capacity.get("requestsPerSecond")
        if capacity.get("source") in ("measured", "status") and requests:
            state.history.capacity = Rates(
                float(requests), float(capacity.get("tokensPerSecond") or 0.0)
            )
            state.capacity_time = capacity.get("lastMeasuredTime")
        return state


def build_observation(
    *,
    now: float,
    current_replicas: int,
    replicas: list[ReplicaScrape],
    pending: int,
    state: ServiceState,
    rejected: Mapping[str, float] | None = None,
    ttft_window: float = TTFT_WINDOW_S,
    demand_window: float = AutoscalingPolicy.demand_window,
    panic_window: float = AutoscalingPolicy.panic_window,
) -> Observation:
    """The Observation for ``decide``; records this tick's TTFT histograms, counters and
    backlog in ``state``.

    A replica counts when it answered ``/load`` and says it is ready. TTFT p95 is over the
    first tokens of the last ``ttft_window`` seconds (each replica's histogram now minus its
    histogram at the window's start, or at its first scrape if younger), merged over every
    replica that answered ``/metrics``; None with fewer than ``MIN_TTFT_OBSERVATIONS``.
    Replicas gone since the previous tick are forgotten.

    Demand needs the counters of every ready replica (an engine without them, or a replica
    whose ``/metrics`` failed, would read as no throughput): without, it is None this tick.
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
        demand=_demand(now, replicas, pending, rejected or {}, state, demand_window, panic_window),
        counting=bool(ready)
        and all(r.counters is not None for r in replicas if r.load and r.ready),
    )


def _demand(
    now: float,
    replicas: list[ReplicaScrape],
    pending: int,
    rejected: Mapping[str, float],
    state: ServiceState,
    window: float,
    panic_window: float,
) -> Demand | None:
    """Record this tick's counters and backlog; the demand over the windows, or None."""
    ready = [r for r in replicas if r.load is not None and r.ready]
    if not ready or any(r.counters is None for r in ready):
        state.counters_seen.clear()
        state.backlog_seen.clear()
        return None
    for r in ready:
        assert r.load is not None and r.counters is not None
        seen = state.counters_seen.setdefault(r.endpoint.key, deque())
        requests, tokens = r.counters
        if seen and (requests < seen[-1].requests or tokens < seen[-1].tokens):
            seen.clear()  # a new process counts from 0
        seen.append(signals.Counters(now, requests, tokens, r.load.waiting > 0))
    for key, count in rejected.items():
        seen = state.rejected_seen.setdefault(key, deque())
        if seen and count < seen[-1].requests:
            seen.clear()  # a restarted gateway counts from 0
        seen.append(signals.Counters(now, count, 0.0, False))
    for series in (state.counters_seen, state.rejected_seen):
        for key, seen in list(series.items()):
            while len(seen) > 2 and seen[1].time <= now - window:
                seen.popleft()
            if seen[-1].time < now - window:
                del series[key]
    backlog = sum(r.load.waiting + r.load.running for r in ready if r.load is not None) + pending
    state.backlog_seen.append(signals.Backlog(now, backlog))
    while len(state.backlog_seen) > 2 and state.backlog_seen[1].time <= now - window:
        state.backlog_seen.popleft()
    return signals.estimate_demand(
        state.counters_seen,
        state.backlog_seen,
        now=now,
        window=window,
        panic_window=panic_window,
        rejected=state.rejected_seen,
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


ESTIMATE_SIGNALS = (
    "demandRequestsPerSecond",
    "demandTokensPerSecond",
    "utilization",
    "replicasNeeded",
    "panic",
    "replicaStartSeconds",
)
"""Keys of ``status.autoscaler.signals`` that only a capacity-sized decision has."""


def autoscaler_status(
    obs: Observation,
    decision: Decision,
    *,
    now: str,
    last_scale_time: str | None,
    capacity_time: str | None = None,
) -> dict[str, Any]:
    """``status.autoscaler``: the decision, its signals and, when it was sized by capacity,
    the demand, utilization and the capacity it used (with where that came from)."""
    status: dict[str, Any] = {
        "lastDecisionTime": now,
        "desiredReplicas": decision.desired,
        "direction": decision.direction,
        "reason": decision.reason,
        "signals": status_signals(obs),
    }
    est = decision.estimate
    if est is not None:
        status["signals"].update({
            "demandRequestsPerSecond": round(est.demand.requests, 3),
            "demandTokensPerSecond": round(est.demand.tokens, 1),
            "utilization": round(est.utilization, 3),
            "replicasNeeded": round(est.replicas_needed, 3),
            "panic": est.panic,
        })  # fmt: skip
        if est.start_time is not None:
            status["signals"]["replicaStartSeconds"] = round(est.start_time, 1)
        capacity: dict[str, Any] = {
            "requestsPerSecond": round(est.capacity.requests, 3),
            "tokensPerSecond": round(est.capacity.tokens, 1),
            "source": est.capacity_source,
        }
        if capacity_time is not None and est.capacity_source in ("measured", "status"):
            capacity["lastMeasuredTime"] = capacity_time
        status["capacity"] = capacity
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


SIGNAL_NAMES = (
    "queue_depth_per_replica",
    "ttft_p95_seconds",
    "kv_cache_usage",
    "demand_requests_per_second",
    "demand_tokens_per_second",
    "capacity_requests_per_second",
    "capacity_tokens_per_second",
    "utilization",
    "replicas_needed",
    "replica_start_seconds",
)
"""Values of ``conveyor_autoscaler_signal{signal}``; those after the first three are NaN
while the decision is the signals' own (no capacity figure or no demand yet)."""


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
        state = self._states.get((namespace, name))
        if state is None:
            state = self._states[(namespace, name)] = ServiceState.from_status(
                llmservice.get("status")
            )
        model = served_name(llmservice)
        runtime, gateways = await asyncio.gather(
            self._endpoints(namespace, name), self._endpoints(namespace, GATEWAY_NAME)
        )
        replicas, (pending, rejected) = await asyncio.gather(
            asyncio.gather(*(self._scrape_replica(e) for e in runtime)),
            self._gateways(gateways, model),
        )
        current = int(spec.get("replicas", policy.min_replicas))
        obs = build_observation(
            now=self.clock(),
            current_replicas=current,
            replicas=list(replicas),
            pending=pending,
            state=state,
            rejected=rejected,
            ttft_window=self.ttft_window,
            demand_window=policy.demand_window,
            panic_window=policy.panic_window,
        )
        measured = state.history.capacity_time
        decision = decide(obs, policy, state.history)
        if state.history.capacity_time != measured:
            state.capacity_time = now_rfc3339()
        if decision.desired != current:
            await self.kube.merge_patch(
                f"{llmservice_path(namespace, name)}/scale",
                {"spec": {"replicas": decision.desired}},
            )
            state.last_scale_time = now_rfc3339()
            message = (
                f"scaled {decision.direction} from {current} to {decision.desired} replicas: "
                f"{decision.reason} ({_describe(obs, policy, decision)})"
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
        load, ready, ttft, counters = None, False, None, None
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
                counters = signals.parse_counters(metrics_text)
            except ValueError as exc:
                log.warning("replica %s: bad /metrics: %s", endpoint.url, exc)
        elif isinstance(metrics_text, (httpx.HTTPError, OSError)):
            log.info("replica %s: /metrics not answered: %s", endpoint.url, _error(metrics_text))
        else:
            raise metrics_text
        return ReplicaScrape(endpoint, load, ready, ttft, counters)

    async def _gateways(self, gateways: list[Endpoint], model: str) -> tuple[int, dict[str, float]]:
        """Requests for ``model`` held by the namespace's gateways (summed over gateway
        replicas), and each gateway's count of requests for it turned away so far."""
        texts = await asyncio.gather(
            *(self.scraper.get_text(f"{g.url}/metrics") for g in gateways), return_exceptions=True
        )
        total, rejected = 0, dict[str, float]()
        for gateway, text in zip(gateways, texts, strict=True):
            if isinstance(text, str):
                try:
                    total += pending_requests(text, model)
                    rejected[gateway.key] = signals.parse_rejected(text, model)
                except ValueError as exc:
                    log.warning("gateway %s: bad /metrics: %s", gateway.url, exc)
            elif isinstance(text, (httpx.HTTPError, OSError)):
                log.info("gateway %s: /metrics not answered: %s", gateway.url, _error(text))
            else:
                raise text
        return total, rejected

    async def _patch_status(
        self, llmservice: dict[str, Any], obs: Observation, decision: Decision, state: ServiceState
    ) -> None:
        meta = llmservice["metadata"]
        status = autoscaler_status(
            obs,
            decision,
            now=now_rfc3339(),
            last_scale_time=state.last_scale_time,
            capacity_time=state.capacity_time,
        )
        old = (llmservice.get("status") or {}).get("autoscaler") or {}
        if "capacity" in old and "capacity" not in status:
            status["capacity"] = old["capacity"]  # kept: what was measured stays remembered
        if _without_time(old) == _without_time(status):
            return  # nothing new to say: spare the apiserver a write per tick
        path = f"{llmservice_path(meta['namespace'], meta['name'])}/status"
        cleared = dict.fromkeys(("ttftP95Seconds", *ESTIMATE_SIGNALS))
        patch = {**status, "signals": {**cleared, **status["signals"]}}
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
        n, est = obs.num_ready, decision.estimate
        values = {
            "queue_depth_per_replica": obs.waiting / n if n else 0.0,
            "ttft_p95_seconds": obs.ttft_p95,
            "kv_cache_usage": sum(r.kv_cache_usage for r in obs.ready) / n if n else 0.0,
            "demand_requests_per_second": None if est is None else est.demand.requests,
            "demand_tokens_per_second": None if est is None else est.demand.tokens,
            "capacity_requests_per_second": None if est is None else est.capacity.requests,
            "capacity_tokens_per_second": None if est is None else est.capacity.tokens,
            "utilization": None if est is None else est.utilization,
            "replicas_needed": None if est is None else est.replicas_needed,
            "replica_start_seconds": None if est is None else est.start_time,
        }
        targets = {
            "queue_depth_per_replica": policy.target_queue_depth,
            "ttft_p95_seconds": policy.target_ttft_p95,
            "kv_cache_usage": policy.target_kv_cache_usage,
            "utilization": policy.target_utilization,
        }
        for signal in SIGNAL_NAMES:
            value, target = values[signal], targets.get(signal)
            m.autoscaler_signal.labels(*labels, signal).set(math.nan if value is None else value)
            if target is not None:
                m.autoscaler_target.labels(*labels, signal).set(target)
        m.autoscaler_decisions.labels(*labels, decision.direction, decision.reason).inc()


def _describe(obs: Observation, policy: AutoscalingPolicy, decision: Decision) -> str:
    n, est = obs.num_ready, decision.estimate
    parts = [
        f"{n} ready",
        f"queue {obs.waiting / n if n else 0:.1f}/replica (target {policy.target_queue_depth:g})",
    ]
    if est is not None:
        parts.append(
            f"demand {est.demand.requests:.2f} req/s over capacity {est.capacity.requests:.2f} "
            f"req/s per replica ({est.capacity_source}): {est.replicas_needed:.2f} replicas"
            + (", panic" if est.panic else "")
        )
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
