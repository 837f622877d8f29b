"""Kubernetes discovery: a pool's replicas are the ready endpoints of EndpointSlices picked by label
(ready and not terminating, as ``conveyor.contracts.endpoint_slice`` reads them).

A pool is (model name, routing policy, EndpointSlice label selector in a namespace). The
command line gives one (``--k8s-service`` or ``--k8s-selector``), or, with
``--k8s-llmservices``, ``llmservice_discovery.py`` adds one per LLMService of the namespace
through :meth:`KubernetesDiscovery.add_pool` / :meth:`remove_pool`.

Each pool has one task: list, then watch from the list's resourceVersion; on any error (the
watch dropping, 410 Gone, the apiserver away) list and watch again after a backoff. The
Kubernetes client sits behind :class:`SliceSource` (list and watch, plain dicts out), so the
event handling is tested with fake events and the kubernetes-facing part stays thin.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from conveyor.contracts import endpoint_slice
from conveyor.contracts.engine_load import NO_LIMITS, Limits
from conveyor.gateway.auth import backend_headers
from conveyor.gateway.pool import Registry
from conveyor.gateway.static_discovery import fetch_models

log = logging.getLogger("conveyor.gateway")

BACKOFF_INITIAL_S = 0.5
"""First wait before re-listing after a failed list or watch."""
BACKOFF_MAX_S = 30.0
"""Longest wait between attempts while the apiserver is away."""
WATCH_TIMEOUT_S = 300
"""Server-side watch timeout; the pool is then listed and watched again."""


@dataclass(frozen=True)
class ApiTimeouts:
    """Client-side bounds of the discovery's calls to the apiserver, so that none waits on its
    socket forever: a frozen or partitioned apiserver answers nothing and closes nothing, and
    kubernetes_asyncio's own default is no timeout at all. A call that times out fails like a
    broken watch: the pool is listed and watched again after the backoff."""

    list_s: float = 30.0
    """Longest wait for a list's whole answer (milliseconds on a healthy apiserver)."""
    connect_s: float = 10.0
    """Longest wait for a connection to the apiserver."""
    watch_idle_s: float = 90.0
    """Longest silence of a watch; the apiserver sends a bookmark every minute on a quiet one,
    so a watch silent this long is dead and is given up."""

    def for_list(self) -> Any:
        import aiohttp

        return aiohttp.ClientTimeout(total=self.list_s, sock_connect=self.connect_s)

    def for_watch(self) -> Any:
        import aiohttp

        return aiohttp.ClientTimeout(
            total=WATCH_TIMEOUT_S + self.watch_idle_s,
            sock_connect=self.connect_s,
            sock_read=self.watch_idle_s,
        )


async def list_and_watch(
    what: str,
    list_once: Callable[[], Awaitable[str]],
    watch: Callable[[str], Awaitable[None]],
    sleep: Callable[[float], Awaitable[None]],
) -> None:
    """List, then watch from the listed resourceVersion, forever: ``list_once()`` lists and
    applies what it found, returning the version; ``watch(version)`` applies each event until
    the watch ends. A failure of either is logged as ``what`` and both are tried again after a
    backoff that doubles up to ``BACKOFF_MAX_S`` and starts over after a good list."""
    backoff = BACKOFF_INITIAL_S
    while True:
        try:
            version = await list_once()
            backoff = BACKOFF_INITIAL_S
            await watch(version)
            continue  # the watch timed out normally: list and watch again
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning(
                "%s failed (%s: %s); retrying in %.1fs", what, type(exc).__name__, exc, backoff
            )
        await sleep(backoff)
        backoff = min(backoff * 2, BACKOFF_MAX_S)


@dataclass(frozen=True)
class K8sPoolSpec:
    namespace: str
    label_selector: str
    """EndpointSlice selector, e.g. ``kubernetes.io/service-name=chat`` or ``conveyor.dev/llmservice=chat``."""
    model: str | None = None
    """Model the pool serves; None reads it from the first ready replica's /v1/models."""
    policy: str | None = None
    """Routing policy of the pool; None is the gateway's default."""
    port_name: str | None = None
    """Which EndpointSlice port to use; None takes the slice's first port."""
    limits: Limits = NO_LIMITS
    """Batch and queue bounds of the pool's replicas, for those whose load is read from
    ``/metrics`` (vLLM, SGLang), which do not say them there."""
    adapters: tuple[str, ...] = ()
    """LoRA adapters the replicas serve beside ``model``: each name routes to them too."""

    @property
    def source(self) -> str:
        return f"k8s:{self.namespace}/{self.label_selector}"


def endpoint_urls(slice_: dict[str, Any], port_name: str | None) -> set[str]:
    """``http://ADDRESS:PORT`` of each endpoint of one EndpointSlice that may take requests
    (``conveyor.contracts.endpoint_slice``: ready, not terminating)."""
    return {endpoint.url for endpoint in endpoint_slice.ready_endpoints(slice_, port_name)}


class EndpointSliceTracker:
    """Ready endpoint URLs of one pool, kept up to date from list results and watch events."""

    def __init__(self, port_name: str | None) -> None:
        self._port_name = port_name
        self._slices: dict[str, set[str]] = {}

    def reset(self, slices: list[dict[str, Any]]) -> None:
        self._slices = {s["metadata"]["name"]: endpoint_urls(s, self._port_name) for s in slices}

    def apply(self, event_type: str, slice_: dict[str, Any]) -> None:
        # BOOKMARK and anything newer carry no endpoints, and no name: a bookmark's metadata
        # is its resourceVersion alone (reading the name first broke the watch every minute)
        if event_type == "DELETED":
            self._slices.pop(slice_["metadata"]["name"], None)
        elif event_type in ("ADDED", "MODIFIED"):
            self._slices[slice_["metadata"]["name"]] = endpoint_urls(slice_, self._port_name)

    def urls(self) -> set[str]:
        return set().union(*self._slices.values()) if self._slices else set()


class SliceSource(Protocol):
    """The Kubernetes boundary: EndpointSlices as plain API dicts."""

    async def list(self, namespace: str, selector: str) -> tuple[list[dict[str, Any]], str]:
        """(slices, resourceVersion)."""
        ...

    def watch(
        self, namespace: str, selector: str, resource_version: str
    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """(event type, slice) until the watch ends; raises when it breaks."""
        ...


class KubernetesDiscovery:
    def __init__(
        self,
        *,
        registry: Registry,
        source: SliceSource,
        client: httpx.AsyncClient,
        timeout_s: float,
        backend_api_key: str | None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._registry = registry
        self._source = source
        self._client = client
        self._timeout = timeout_s
        self._headers = backend_headers(backend_api_key)
        self._sleep = sleep
        # Each pool's state by its watch (``K8sPoolSpec.source``): its task, the spec it now
        # publishes with (a changed routing policy or limits replaces it in place), the model
        # learned from a replica, and its slices.
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._specs: dict[str, K8sPoolSpec] = {}
        self._models: dict[str, str] = {}
        self._trackers: dict[str, EndpointSliceTracker] = {}
        self.synced = asyncio.Event()
        """Set once every pool has been listed at least once."""
        self._listed: set[str] = set()

    def add_pool(self, spec: K8sPoolSpec) -> None:
        if spec.source not in self._tasks:
            self.synced.clear()
            self._specs[spec.source] = spec
            self._tasks[spec.source] = asyncio.create_task(self._run_pool(spec), name=spec.source)

    async def update_pool(self, spec: K8sPoolSpec) -> None:
        """A pool's routing policy, limits or adapters changed (its watch, port and model did
        not): the pool is published again with them, its watch, replicas and their load kept."""
        if spec.source not in self._tasks:
            self.add_pool(spec)
            return
        self._specs[spec.source] = spec
        tracker = self._trackers.get(spec.source)
        if spec.source in self._listed and tracker is not None:
            await self._publish(spec.source, tracker)

    async def remove_pool(self, spec: K8sPoolSpec) -> None:
        task = self._tasks.pop(spec.source, None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        for state in (self._specs, self._models, self._trackers):
            state.pop(spec.source, None)
        self._listed.discard(spec.source)
        self._registry.forget(spec.source)

    async def close(self) -> None:
        for spec in list(self._specs.values()):
            await self.remove_pool(spec)

    async def _run_pool(self, spec: K8sPoolSpec) -> None:
        source = spec.source
        tracker = self._trackers[source] = EndpointSliceTracker(spec.port_name)

        async def list_slices() -> str:
            slices, version = await self._source.list(spec.namespace, spec.label_selector)
            tracker.reset(slices)
            await self._publish(source, tracker)
            self._listed.add(source)
            if self._listed >= self._tasks.keys():
                self.synced.set()
            return version

        async def watch_slices(version: str) -> None:
            async for event_type, slice_ in self._source.watch(
                spec.namespace, spec.label_selector, version
            ):
                tracker.apply(event_type, slice_)
                await self._publish(source, tracker)

        await list_and_watch(
            f"EndpointSlice watch {source}", list_slices, watch_slices, self._sleep
        )

    async def _publish(self, source: str, tracker: EndpointSliceTracker) -> None:
        spec = self._specs[source]
        urls = tracker.urls()
        model = spec.model or self._models.get(source)
        if model is None and urls:
            model = await self._learn_model(spec, urls)
        if model is None:
            return  # no replica has told us its model yet; the next event asks again
        names = (model, *spec.adapters)
        self._registry.sync(
            source,
            {name: urls for name in names},
            {name: spec.policy for name in names},
            {name: spec.limits for name in names},
        )

    async def _learn_model(self, spec: K8sPoolSpec, urls: set[str]) -> str | None:
        for url in sorted(urls):
            try:
                models = await fetch_models(self._client, url, self._headers, self._timeout)
            except (httpx.HTTPError, ValueError):
                continue
            if models:
                self._models[spec.source] = models[0]
                return models[0]
        return None


class KubernetesSliceSource:
    """The real :class:`SliceSource` over kubernetes_asyncio (in-cluster or kubeconfig)."""

    def __init__(self, api_client: Any, timeouts: ApiTimeouts | None = None) -> None:
        from kubernetes_asyncio import client

        self._api_client = api_client
        self._api = client.DiscoveryV1Api(api_client)
        self.timeouts = timeouts or ApiTimeouts()

    @classmethod
    async def connect(cls) -> KubernetesSliceSource:
        from kubernetes_asyncio import client, config

        try:
            config.load_incluster_config()  # type: ignore[no-untyped-call]  # untyped library
        except config.ConfigException:
            await config.load_kube_config()
        return cls(client.ApiClient())

    @property
    def api_client(self) -> Any:
        """The kubernetes_asyncio client (shared with the LLMService watch)."""
        return self._api_client

    async def close(self) -> None:
        await self._api_client.close()

    async def list(self, namespace: str, selector: str) -> tuple[list[dict[str, Any]], str]:
        result = await self._api.list_namespaced_endpoint_slice(
            namespace, label_selector=selector, _request_timeout=self.timeouts.for_list()
        )
        slices = [self._api_client.sanitize_for_serialization(item) for item in result.items]
        return slices, result.metadata.resource_version

    async def watch(
        self, namespace: str, selector: str, resource_version: str
    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        from kubernetes_asyncio import watch

        async with watch.Watch() as w:
            async for event in w.stream(
                self._api.list_namespaced_endpoint_slice,
                namespace,
                label_selector=selector,
                resource_version=resource_version,
                timeout_seconds=WATCH_TIMEOUT_S,
                allow_watch_bookmarks=True,
                _request_timeout=self.timeouts.for_watch(),
            ):
                yield event["type"], event["raw_object"]
