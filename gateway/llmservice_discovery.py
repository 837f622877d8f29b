"""One pool per LLMService of the gateway's namespace (``--k8s-llmservices``).

The operator runs one shared gateway per namespace. This watcher lists and watches the
namespace's LLMServices and keeps one :class:`K8sPoolSpec` per LLMService in the
:class:`KubernetesDiscovery`: the model name and routing policy come from the LLMService, the
replicas from the EndpointSlices of its runtime Service (picked by label). An LLMService
added, changed or deleted adds, replaces or removes its pool; the other pools are untouched.

The Kubernetes client sits behind :class:`LLMServiceSource` (plain dicts), as in
``k8s_discovery.py``, so the event handling is tested with fake events.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from conveyor.contracts.engine_load import Limits
from conveyor.gateway.k8s_discovery import (
    WATCH_TIMEOUT_S,
    ApiTimeouts,
    K8sPoolSpec,
    KubernetesDiscovery,
    list_and_watch,
)

log = logging.getLogger("conveyor.gateway")

# The LLMService resource and the labels the operator puts on runtime Services (ARCHITECTURE.md).
GROUP, VERSION, PLURAL = "conveyor.dev", "v1alpha1", "llmservices"
LLMSERVICE_LABEL = "conveyor.dev/llmservice"
COMPONENT_LABEL = "app.kubernetes.io/component"
PORT_NAME = "http"


def pool_spec(namespace: str, llmservice: dict[str, Any]) -> K8sPoolSpec | None:
    """The pool of one LLMService (None while it is being deleted)."""
    meta = llmservice["metadata"]
    if meta.get("deletionTimestamp"):
        return None
    spec = llmservice.get("spec") or {}
    name = meta["name"]
    model = spec.get("model") or {}
    return K8sPoolSpec(
        namespace=namespace,
        label_selector=f"{LLMSERVICE_LABEL}={name},{COMPONENT_LABEL}=runtime",
        model=model.get("servedName") or name,
        policy=(spec.get("routing") or {}).get("policy"),
        port_name=PORT_NAME,
        limits=Limits.of_spec(spec),
        adapters=tuple(a["name"] for a in model.get("loraAdapters") or [] if a.get("name")),
    )


def same_pool(a: K8sPoolSpec, b: K8sPoolSpec) -> bool:
    """The same watch, port and model: what differs (routing policy, limits, LoRA adapters)
    changes in place."""
    return (a.source, a.port_name, a.model) == (b.source, b.port_name, b.model)


class LLMServiceSource(Protocol):
    """The Kubernetes boundary: LLMServices as plain API dicts."""

    async def list(self, namespace: str) -> tuple[list[dict[str, Any]], str]:
        """(LLMServices, resourceVersion)."""
        ...

    def watch(
        self, namespace: str, resource_version: str
    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """(event type, LLMService) until the watch ends; raises when it breaks."""
        ...


class LLMServiceWatcher:
    def __init__(
        self,
        *,
        namespace: str,
        source: LLMServiceSource,
        discovery: KubernetesDiscovery,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._namespace = namespace
        self._source = source
        self._discovery = discovery
        self._sleep = sleep
        self._pools: dict[str, K8sPoolSpec] = {}
        """LLMService name -> its pool, as added to the discovery."""
        self.synced = asyncio.Event()
        """Set once the LLMServices were listed and each of their pools listed once; never cleared,
        so a new LLMService does not make the gateway unready for the models it already serves."""

    @property
    def pools(self) -> dict[str, K8sPoolSpec]:
        return dict(self._pools)

    async def run(self) -> None:
        await list_and_watch(
            f"LLMService watch in {self._namespace}", self._list, self._watch, self._sleep
        )

    async def _list(self) -> str:
        items, version = await self._source.list(self._namespace)
        await self._replace({i["metadata"]["name"]: i for i in items})
        if not self.synced.is_set():
            if self._pools:
                await self._discovery.synced.wait()
            self.synced.set()
        return version

    async def _watch(self, version: str) -> None:
        async for event_type, item in self._source.watch(self._namespace, version):
            await self._apply(event_type, item)

    async def _replace(self, items: dict[str, dict[str, Any]]) -> None:
        for name in self._pools.keys() - items.keys():
            await self._set(name, None)
        for name, item in items.items():
            await self._set(name, pool_spec(self._namespace, item))

    async def _apply(self, event_type: str, item: dict[str, Any]) -> None:
        # a BOOKMARK has no name (its metadata is its resourceVersion alone): nothing to apply
        if event_type == "DELETED":
            await self._set(item["metadata"]["name"], None)
        elif event_type in ("ADDED", "MODIFIED"):
            await self._set(item["metadata"]["name"], pool_spec(self._namespace, item))

    async def _set(self, name: str, spec: K8sPoolSpec | None) -> None:
        old = self._pools.get(name)
        if old == spec:
            return
        if old is not None and spec is not None and same_pool(old, spec):
            # Only its routing policy or limits changed: the pool keeps its replicas, their
            # load and the requests held for it at the gateway.
            self._pools[name] = spec
            await self._discovery.update_pool(spec)
            log.info(
                "LLMService %s/%s: pool %s now routing %s, %s",
                self._namespace, name, spec.model, spec.policy, spec.limits,
            )  # fmt: skip
            return
        if old is not None:
            await self._discovery.remove_pool(old)
            del self._pools[name]
            log.info("LLMService %s/%s: pool %s removed", self._namespace, name, old.model)
        if spec is not None:
            self._pools[name] = spec
            self._discovery.add_pool(spec)
            log.info(
                "LLMService %s/%s: pool %s (routing %s)",
                self._namespace,
                name,
                spec.model,
                spec.policy,
            )


class KubernetesLLMServiceSource:
    """The real :class:`LLMServiceSource` over kubernetes_asyncio."""

    def __init__(self, api_client: Any, timeouts: ApiTimeouts | None = None) -> None:
        from kubernetes_asyncio import client

        self._api = client.CustomObjectsApi(api_client)
        self.timeouts = timeouts or ApiTimeouts()

    async def list(self, namespace: str) -> tuple[list[dict[str, Any]], str]:
        result = await self._api.list_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, _request_timeout=self.timeouts.for_list()
        )
        return result.get("items") or [], result["metadata"]["resourceVersion"]

    async def watch(
        self, namespace: str, resource_version: str
    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        from kubernetes_asyncio import watch

        async with watch.Watch() as w:
            async for event in w.stream(
                self._api.list_namespaced_custom_object,
                GROUP,
                VERSION,
                namespace,
                PLURAL,
                resource_version=resource_version,
                timeout_seconds=WATCH_TIMEOUT_S,
                allow_watch_bookmarks=True,
                _request_timeout=self.timeouts.for_watch(),
            ):
                yield event["type"], event["raw_object"]
