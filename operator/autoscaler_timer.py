"""The autoscaler's timer: observe one LLMService, call ``decide``, write the result.

Each tick (a kopf timer per LLMService, ``--autoscale-interval``):

1. the ready replicas from the LLMService's EndpointSlices (ready endpoints, port ``http``);
2. each scraped directly and concurrently, with a per-replica timeout: ``GET /load`` (queue,
   running, KV usage, still loading?) and ``GET /metrics`` (the TTFT histogram, of which only
   the change over the last ``--autoscale-ttft-window`` seconds counts; the finished-request
   and token counters, whose change over the LLMService's demand and panic windows, with the
   backlog's, gives demand and, from replicas that had a queue throughout, capacity); a
   vLLM or SGLang replica has no ``/load``: all of it is read from its ``/metrics``, under
   its engine's names (``conveyor.contracts.engine_load``), so ``decide`` stays engine-blind;
3. the namespace gateway's replicas (the ``conveyor-gateway`` Service's EndpointSlices),
   ``GET /metrics``, ``conveyor_gateway_pending_requests{model=...}`` summed over gateways:
   requests held because no replica is ready (scale from zero);
   ``conveyor_gateway_backend_in_flight{model=...}``: requests sent to the replicas and not
   answered yet, of which those beyond the replicas' own running and waiting are on their way
   in (backlog too); and each gateway's count of requests for the model it answered 429 or 503
   (demand that no replica took);
4. ``decide(observation, policy, history)``; a change of replicas is written through the scale
   subresource and posted as an Event; the decision and signals go to ``status.autoscaler``
   and to the ``conveyor_autoscaler_*`` metrics.

What is kept between ticks (decision history, recent TTFT histograms and counters per
replica, the backlog) is keyed by namespace/name and dropped when the LLMService is deleted or
autoscaling is turned off. The capacity estimate is also written to ``status.autoscaler.capacity``
and read back from there when the operator starts, so a restart does not forget it.
The HTTP client and the Kubernetes client are the two boundaries; both are passed in. What
turns scrapes into an ``Observation`` is pure and lives in ``autoscaler_observe``; what status,
metrics and Events say about a decision, in ``autoscaler_status``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from typing import Any, Protocol

import httpx

from conveyor.contracts.engine_load import (
    METRICS_ENGINES,
    METRICS_PATH,
    NO_LIMITS,
    EngineMetrics,
    Limits,
    load_from_metrics,
)
from conveyor.operator import signals
from conveyor.operator.autoscaler import decide
from conveyor.operator.autoscaler_model import AutoscalingPolicy, Decision, Observation
from conveyor.operator.autoscaler_observe import (
    SERVICE_NAME_LABEL,
    TTFT_WINDOW_S,
    Endpoint,
    ReplicaScrape,
    ServiceState,
    build_observation,
    endpointslices_path,
    gateway_counts,
    load_signals,
    parse_load,
    pods_path,
    ready_endpoints,
    start_seconds,
)
from conveyor.operator.autoscaler_status import (
    ESTIMATE_SIGNALS,
    SIGNAL_NAMES,
    autoscaler_status,
    describe,
    signal_values,
    without_time,
)
from conveyor.operator.kube import ApiError, Kube
from conveyor.operator.metrics import OperatorMetrics
from conveyor.operator.names import GATEWAY_NAME, PORT_NAME, runtime_selector, selector_string
from conveyor.operator.reconciler import PostEvent, llmservice_path, now_rfc3339
from conveyor.operator.runtime_manifests import served_name

log = logging.getLogger("conveyor.operator.autoscaler")


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


# ---- the timer ---------------------------------------------------------------------------


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
        engine = METRICS_ENGINES.get(spec.get("engine") or "conveyor")
        limits = Limits.of_spec(spec)
        replicas, (pending, in_flight, rejected) = await asyncio.gather(
            asyncio.gather(*(self._scrape_replica(e, engine, limits) for e in runtime)),
            self._gateways(gateways, model),
        )
        current = int(spec.get("replicas", policy.min_replicas))
        obs = build_observation(
            now=self.clock(),
            current_replicas=current,
            replicas=list(replicas),
            pending=pending,
            in_flight=in_flight,
            state=state,
            rejected=rejected,
            ttft_window=self.ttft_window,
            demand_window=policy.demand_window,
            panic_window=policy.panic_window,
        )
        if not state.start_read and obs.num_ready > 0:
            state.start_read = True  # once: a list of pods per tick is the apiserver's load
            state.history.start_time = await self._start_seconds(namespace, name)
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
                f"{decision.reason} ({describe(obs, policy, decision)})"
            )
            log.info("%s/%s: %s", namespace, name, message)
            event = "ScaledUp" if decision.desired > current else "ScaledDown"
            self.post_event(llmservice, "Normal", event, message)
        await self._patch_status(llmservice, obs, decision, state)
        self._record_metrics(namespace, name, obs, policy, decision)
        return decision

    async def _start_seconds(self, namespace: str, name: str) -> float | None:
        """How long the LLMService's ready pods took to start; None when none tells (or pods
        may not be read: an RBAC without them, logged)."""
        try:
            pods = await self.kube.list(
                pods_path(namespace), label_selector=selector_string(runtime_selector(name))
            )
        except ApiError as exc:
            if exc.status != 403:
                raise
            log.warning("cannot list pods (%s): replicas' start time is learned on scaling", exc)
            return None
        return start_seconds(pods)

    async def _endpoints(self, namespace: str, service: str) -> list[Endpoint]:
        slices = await self.kube.list(
            endpointslices_path(namespace), label_selector=f"{SERVICE_NAME_LABEL}={service}"
        )
        return ready_endpoints(slices, PORT_NAME)

    async def _scrape_replica(
        self, endpoint: Endpoint, engine: EngineMetrics | None = None, limits: Limits = NO_LIMITS
    ) -> ReplicaScrape:
        """One replica's load, TTFT histogram and counters: from ``/load`` and ``/metrics``
        (Conveyor), or all from ``/metrics`` for an engine that has no ``/load`` (vLLM,
        SGLang), read through ``conveyor.contracts.engine_load`` with the batch and queue
        bounds its LLMService gave it (``limits``), which such an engine does not export."""
        if engine is not None:
            return await self._scrape_metrics_only(endpoint, engine, limits)
        load_text, metrics_text = await asyncio.gather(
            self.scraper.get_text(f"{endpoint.url}/load"),
            self.scraper.get_text(f"{endpoint.url}/metrics"),
            return_exceptions=True,
        )
        load, ready, ttft, counters = None, False, None, None
        if (text := _answered(load_text, f"replica {endpoint.url}: /load")) is not None:
            try:
                load, ready = parse_load(text)
            except ValueError as exc:
                log.warning("replica %s: bad /load: %s", endpoint.url, exc)
        if (text := _answered(metrics_text, f"replica {endpoint.url}: /metrics")) is not None:
            try:
                ttft = signals.parse_histogram(text)
                counters = signals.parse_counters(text)
            except ValueError as exc:
                log.warning("replica %s: bad /metrics: %s", endpoint.url, exc)
        return ReplicaScrape(endpoint, load, ready, ttft, counters)

    async def _scrape_metrics_only(
        self, endpoint: Endpoint, engine: EngineMetrics, limits: Limits
    ) -> ReplicaScrape:
        result: str | BaseException
        try:
            result = await self.scraper.get_text(f"{endpoint.url}{METRICS_PATH}")
        except (httpx.HTTPError, OSError) as exc:
            result = exc
        load, ready, ttft, counters = None, False, None, None
        if (text := _answered(result, f"replica {endpoint.url}: /metrics")) is not None:
            try:
                load, ready = load_signals(load_from_metrics(text, engine, limits))
                ttft = signals.parse_histogram(text, engine.ttft)
                counters = signals.parse_counters(
                    text, engine.requests, engine.prompt_tokens, engine.generation_tokens
                )
            except ValueError as exc:
                log.warning("replica %s: bad /metrics: %s", endpoint.url, exc)
        return ReplicaScrape(endpoint, load, ready, ttft, counters)

    async def _gateways(
        self, gateways: list[Endpoint], model: str
    ) -> tuple[int, int, dict[str, float]]:
        """Requests for ``model`` held by the namespace's gateways and those they have open on
        its replicas (each summed over gateway replicas), and each gateway's count of requests
        for it turned away so far."""
        texts = await asyncio.gather(
            *(self.scraper.get_text(f"{g.url}/metrics") for g in gateways), return_exceptions=True
        )
        held = in_flight = 0
        rejected = dict[str, float]()
        for gateway, result in zip(gateways, texts, strict=True):
            if (text := _answered(result, f"gateway {gateway.url}: /metrics")) is not None:
                try:
                    counts = gateway_counts(text, model)
                except ValueError as exc:
                    log.warning("gateway %s: bad /metrics: %s", gateway.url, exc)
                    continue
                held += counts.held
                in_flight += counts.in_flight
                rejected[gateway.key] = counts.rejected
        return held, in_flight, rejected

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
        if without_time(old) == without_time(status):
            return  # nothing new to say: spare the apiserver a write per tick
        path = f"{llmservice_path(meta['namespace'], meta['name'])}/status"
        cleared = dict.fromkeys(("ttftP95Seconds", *ESTIMATE_SIGNALS))
        patch = {"scaleDownHeldBy": None, **status, "signals": {**cleared, **status["signals"]}}
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
        values, targets = signal_values(obs, policy, decision)
        for signal in SIGNAL_NAMES:
            value, target = values[signal], targets.get(signal)
            m.autoscaler_signal.labels(*labels, signal).set(math.nan if value is None else value)
            if target is not None:
                m.autoscaler_target.labels(*labels, signal).set(target)
        m.autoscaler_decisions.labels(*labels, decision.direction, decision.reason).inc()


def _answered(result: str | BaseException, what: str) -> str | None:
    """One scrape's text; None, logged, where the replica or gateway did not answer (an HTTP
    or network error); any other error is raised."""
    if isinstance(result, str):
        return result
    if isinstance(result, (httpx.HTTPError, OSError)):
        log.info("%s not answered: %s", what, _error(result))
        return None
    raise result


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
