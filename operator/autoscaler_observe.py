"""What the autoscaler's timer sees of one LLMService, turned into an ``Observation``.

Pure parts, each tick: the ready replicas from the LLMService's EndpointSlices; each replica's
``/load`` (queue, running, KV usage, still loading?) and ``/metrics`` (the TTFT histogram, of
which only the change over the last ``--autoscale-ttft-window`` seconds counts; the
finished-request and token counters, whose change over the demand and panic windows, with the
backlog's, gives demand and, from replicas that had a queue throughout, capacity); the
gateways' requests held for the model (scale from zero) and turned away (429, 503). What is
kept between ticks for this is a ``ServiceState``.
"""

from __future__ import annotations

import json
import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from conveyor.contracts import endpoint_slice
from conveyor.contracts.load import ReplicaLoad
from conveyor.contracts.pod_status import api_time, ready_condition
from conveyor.gateway.metrics import BACKEND_IN_FLIGHT, PENDING_REQUESTS, REQUESTS_TOTAL
from conveyor.operator import signals
from conveyor.operator.autoscaler_model import (
    AutoscalingPolicy,
    Demand,
    History,
    Observation,
    Rates,
    ReplicaSignals,
)
from conveyor.operator.signals import REJECTED_CODES

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


@dataclass(frozen=True)
class Endpoint:
    """One ready endpoint of a Service: its pod (for per-replica history) and base URL."""

    key: str
    url: str


def ready_endpoints(slices: Iterable[dict[str, Any]], port_name: str) -> list[Endpoint]:
    """Endpoints of EndpointSlices (API JSON) that may take requests
    (``conveyor.contracts.endpoint_slice``), at the port named ``port_name``; the same address
    in several slices appears once."""
    found: dict[str, Endpoint] = {}
    for slice_ in slices:
        for ready in endpoint_slice.ready_endpoints(slice_, port_name):
            found.setdefault(ready.url, Endpoint(key=ready.pod or ready.url, url=ready.url))
    return sorted(found.values(), key=lambda e: e.url)


def pods_path(namespace: str) -> str:
    return f"/api/v1/namespaces/{namespace}/pods"


def start_seconds(pods: Iterable[dict[str, Any]]) -> float | None:
    """How long the service's replicas took from their pod's creation to Ready (scheduling,
    image, process start, model load): the median over its ready pods whose containers never
    restarted (a restart's readiness says nothing of a start). None when none is such a pod.

    The timer reads this once there is a ready replica, so that the first scale-up already
    sizes for what piles up while new replicas start, rather than learning it from that
    scale-up's own wait."""
    seen = []
    for pod in pods:
        meta, status = pod["metadata"], pod.get("status") or {}
        if meta.get("deletionTimestamp") or any(
            c.get("restartCount", 0) for c in status.get("containerStatuses") or []
        ):
            continue
        ready = ready_condition(pod)
        if ready and ready.get("lastTransitionTime") and meta.get("creationTimestamp"):
            since = api_time(ready["lastTransitionTime"]) - api_time(meta["creationTimestamp"])
            if since.total_seconds() >= 0:
                seen.append(since.total_seconds())
    return statistics.median(seen) if seen else None


def parse_load(text: str) -> tuple[ReplicaSignals, bool]:
    """A replica's ``/load`` JSON (``conveyor.contracts.load``) as (signals, ready);
    ValueError naming what is wrong."""
    return load_signals(ReplicaLoad.from_json(json.loads(text)))


def load_signals(load: ReplicaLoad) -> tuple[ReplicaSignals, bool]:
    """A replica's load record, whatever engine filled it, as (signals, ready)."""
    replica = ReplicaSignals(
        waiting=load.waiting,
        running=load.running,
        max_running=load.max_running_requests,
        kv_cache_usage=load.kv_cache_usage,
    )
    return replica, load.ready


@dataclass(frozen=True)
class GatewayCounts:
    """What one gateway's ``/metrics`` says of a model."""

    held: int
    """``conveyor_gateway_pending_requests``: held because no replica is ready, or (queueing
    at the gateway) none has room."""
    in_flight: int
    """``conveyor_gateway_backend_in_flight``, summed over backends: sent to the model's
    replicas and not answered yet."""
    rejected: float
    """``conveyor_gateway_requests_total`` answered 429 or 503 so far: demand no replica took."""


def gateway_counts(text: str, model: str) -> GatewayCounts:
    """``GatewayCounts`` for ``model`` from one gateway's Prometheus text, in one pass."""
    held = in_flight = rejected = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("model") != model:
                continue
            if family.name == PENDING_REQUESTS:
                held += sample.value
            elif family.name == BACKEND_IN_FLIGHT:
                in_flight += sample.value
            elif sample.name == REQUESTS_TOTAL and sample.labels.get("code") in REJECTED_CODES:
                rejected += sample.value
    return GatewayCounts(int(held), int(in_flight), rejected)


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
    start_read: bool = False
    """The pods were read once for how long a replica takes to start (``start_seconds``);
    from then on the autoscaler's own scale-ups refine it."""

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
    in_flight: int = 0,
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

    ``in_flight`` is what the gateways sent to the replicas and have not had answered: beyond
    what the replicas count as running and waiting, it is requests a replica has not taken in
    yet (its HTTP server still reading or tokenizing them: a quarter-core replica under a 2x
    step hid a growing backlog this way, and the step took 12 s to read as a burst). They are
    backlog (``Observation.unseen_requests``) and so arrivals.
    """
    ready = tuple(r.load for r in replicas if r.load is not None and r.ready)
    unseen = max(0, in_flight - sum(r.waiting + r.running for r in ready))
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
        unseen_requests=unseen,
        demand=_demand(
            now, replicas, pending, unseen, rejected or {}, state, demand_window, panic_window
        ),
        counting=bool(ready)
        and all(r.counters is not None for r in replicas if r.load and r.ready),
    )


def _demand(
    now: float,
    replicas: list[ReplicaScrape],
    held: int,
    unseen: int,
    rejected: Mapping[str, float],
    state: ServiceState,
    window: float,
    panic_window: float,
) -> Demand | None:
    """Record this tick's counters and backlog (``held`` at the gateways, ``unseen``: sent and
    not yet taken in by a replica); the demand over the windows, or None. A replica has a
    queue when it says so or a gateway holds requests (which it does only while every replica
    is full)."""
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
        seen.append(signals.Counters(now, requests, tokens, r.load.waiting > 0 or held > 0))
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
    backlog = sum(r.load.waiting + r.load.running for r in ready if r.load is not None)
    backlog += held + unseen
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
