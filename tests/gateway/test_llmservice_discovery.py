"""One pool per LLMService: the watcher's event handling, with fake sources at both boundaries."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx

from conveyor.contracts.engine_load import Limits
from conveyor.gateway.k8s_discovery import KubernetesDiscovery
from conveyor.gateway.llmservice_discovery import LLMServiceWatcher, pool_spec
from conveyor.gateway.pool import Registry
from conveyor.gateway.routing import make_policy


def llmservice(
    name: str, *, served: str | None = None, policy: str | None = None, deleting: bool = False
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": "ns"}
    if deleting:
        meta["deletionTimestamp"] = "2030-01-01T00:00:00Z"
    model: dict[str, Any] = {"builtin": "conveyor-tiny"}
    if served:
        model["servedName"] = served
    spec: dict[str, Any] = {"model": model}
    if policy:
        spec["routing"] = {"policy": policy}
    return {"metadata": meta, "spec": spec}


def endpoint_slice(name: str, address: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "ports": [{"name": "http", "port": 8000}],
        "endpoints": [{"addresses": [address], "conditions": {"ready": True}}],
    }


class FakeServices:
    def __init__(self, initial: list[dict[str, Any]]) -> None:
        self.initial = initial
        self.events: asyncio.Queue[tuple[str, dict[str, Any]]] = asyncio.Queue()
        self.lists = 0

    async def list(self, namespace: str) -> tuple[list[dict[str, Any]], str]:
        assert namespace == "ns"
        self.lists += 1
        return self.initial, "1"

    async def watch(
        self, namespace: str, resource_version: str
    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        while True:
            yield await self.events.get()


class FakeSlices:
    """Each LLMService's runtime Service has one slice with one replica, chosen by its selector."""

    def __init__(self, addresses: dict[str, str]) -> None:
        self.addresses = addresses
        self.selectors: list[str] = []

    async def list(self, namespace: str, selector: str) -> tuple[list[dict[str, Any]], str]:
        self.selectors.append(selector)
        name = selector.split(",")[0].split("=")[1]
        return [endpoint_slice(name, self.addresses[name])], "1"

    async def watch(
        self, namespace: str, selector: str, resource_version: str
    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        await asyncio.Event().wait()  # no changes; cancelled when the pool goes
        yield ("BOOKMARK", {})


async def until(condition, what: str) -> None:
    async with asyncio.timeout(5):
        while not condition():
            await asyncio.sleep(0)
    assert condition(), what


@contextlib.asynccontextmanager
async def watching(
    services: FakeServices, slices: FakeSlices
) -> AsyncIterator[tuple[Registry, LLMServiceWatcher]]:
    """A registry fed by a running watcher over the fake sources, listed once; stopped and
    its pools closed on the way out."""
    registry = Registry(
        lambda name: make_policy(name or "prefix-aware", bounded_load_factor=1.25, ring_vnodes=10)
    )
    async with httpx.AsyncClient(
        transport=httpx.MockTransport(lambda r: httpx.Response(500))
    ) as client:
        discovery = KubernetesDiscovery(
            registry=registry, source=slices, client=client, timeout_s=1.0, backend_api_key=None
        )
        watcher = LLMServiceWatcher(namespace="ns", source=services, discovery=discovery)
        task = asyncio.create_task(watcher.run())
        try:
            await until(watcher.synced.is_set, "first list of LLMServices and their slices")
            yield registry, watcher
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await discovery.close()


def test_pool_spec_takes_model_and_policy_from_the_llmservice() -> None:
    spec = pool_spec("ns", llmservice("chat", served="qwen", policy="least-load"))
    assert spec is not None
    assert spec.label_selector == "conveyor.dev/llmservice=chat,app.kubernetes.io/component=runtime"
    assert (spec.model, spec.policy, spec.port_name) == ("qwen", "least-load", "http")
    default = pool_spec("ns", llmservice("chat"))
    assert default is not None and default.model == "chat" and default.policy is None
    assert pool_spec("ns", llmservice("chat", deleting=True)) is None
    assert default.limits == Limits()


def test_pool_spec_takes_the_batch_and_queue_bounds_the_replicas_were_started_with() -> None:
    obj = llmservice("chat")
    obj["spec"]["engine"] = "sglang"
    obj["spec"]["runtime"] = {"maxRunningRequests": 8, "maxQueuedRequests": 0}
    spec = pool_spec("ns", obj)
    assert spec is not None and spec.limits == Limits(max_running=8, max_queued=0)


async def test_pools_follow_llmservices_added_changed_and_deleted() -> None:
    services = FakeServices([llmservice("chat"), llmservice("code", policy="round-robin")])
    slices = FakeSlices({"chat": "198.18.0.5", "code": "198.18.0.6", "embed": "198.18.0.7"})
    async with watching(services, slices) as (registry, watcher):
        assert registry.served_models() == ["chat", "code"]
        assert list(registry.pools["chat"].replicas) == ["http://198.18.0.5:8000"]
        assert registry.pools["code"].policy.name == "round-robin"

        await services.events.put(("ADDED", llmservice("embed", served="e5")))
        await until(
            lambda: "e5" in registry.pools and registry.pools["e5"].replicas,
            "a new LLMService's pool",
        )
        await services.events.put(("MODIFIED", llmservice("chat", served="chat-v2")))
        await until(
            lambda: "chat" not in registry.pools and "chat-v2" in registry.pools, "a renamed model"
        )
        await services.events.put(("MODIFIED", llmservice("code", deleting=True)))
        await until(lambda: "code" not in registry.pools, "an LLMService being deleted")
        await services.events.put(("DELETED", llmservice("embed", served="e5")))
        await until(lambda: registry.served_models() == ["chat-v2"], "a deleted LLMService")
        assert watcher.synced.is_set()  # never cleared by later changes

        # A bookmark as the apiserver sends one (no name) passes without breaking the watch:
        # the next event is applied from the same watch, with no second list.
        bookmark = {"kind": "LLMService", "metadata": {"resourceVersion": "42"}}
        await services.events.put(("BOOKMARK", bookmark))
        await services.events.put(("ADDED", llmservice("embed", served="e5")))
        await until(lambda: "e5" in registry.pools, "an LLMService added after a bookmark")
        assert services.lists == 1


def with_runtime(obj: dict[str, Any], **runtime: int) -> dict[str, Any]:
    obj["spec"]["engine"] = "vllm"
    obj["spec"]["runtime"] = runtime
    return obj


async def test_a_changed_policy_or_limit_keeps_the_pool_its_replicas_and_their_watch() -> None:
    services = FakeServices([with_runtime(llmservice("chat"), maxRunningRequests=8)])
    slices = FakeSlices({"chat": "198.18.0.5"})
    url = "http://198.18.0.5:8000"
    async with watching(services, slices) as (registry, _watcher):
        pool, replica = registry.pools["chat"], registry.replicas[url]
        assert registry.limits_of(url) == Limits(max_running=8)

        edited = with_runtime(llmservice("chat", policy="least-load"), maxRunningRequests=4)
        await services.events.put(("MODIFIED", edited))
        await until(lambda: registry.limits_of(url) == Limits(max_running=4), "the new limit")
        assert registry.pools["chat"] is pool and registry.replicas[url] is replica
        assert pool.policy.name == "least-load"
        await services.events.put(("MODIFIED", llmservice("chat", policy="least-load")))
        await until(lambda: registry.limits_of(url) == Limits(), "the limit unset")
        assert registry.pools["chat"] is pool
        assert len(slices.selectors) == 1, "the slices were listed once: the watch went on"
    assert registry.limits_of(url) == Limits() and registry.pools == {}


async def test_a_namespace_without_llmservices_is_synced_with_no_pools() -> None:
    registry = Registry(
        lambda name: make_policy(name or "prefix-aware", bounded_load_factor=1.25, ring_vnodes=10)
    )
    async with httpx.AsyncClient() as client:
        discovery = KubernetesDiscovery(
            registry=registry,
            source=FakeSlices({}),
            client=client,
            timeout_s=1.0,
            backend_api_key=None,
        )
        watcher = LLMServiceWatcher(namespace="ns", source=FakeServices([]), discovery=discovery)
        task = asyncio.create_task(watcher.run())
        await until(watcher.synced.is_set, "synced with nothing to serve")
        assert registry.served_models() == []
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def with_adapters(obj: dict[str, Any], *names: str) -> dict[str, Any]:
    obj["spec"]["model"]["loraAdapters"] = [{"name": n, "path": f"/adapters/{n}"} for n in names]
    return obj


async def test_an_llmservices_lora_adapters_route_to_its_replicas() -> None:
    services = FakeServices([with_adapters(llmservice("chat"), "sql", "legal")])
    slices = FakeSlices({"chat": "198.18.0.5"})
    async with watching(services, slices) as (registry, _):
        assert registry.served_models() == ["chat", "legal", "sql"]
        assert list(registry.pools["sql"].replicas) == ["http://198.18.0.5:8000"]
        await services.events.put(("MODIFIED", with_adapters(llmservice("chat"), "sql")))
        await until(lambda: "legal" not in registry.pools, "a removed adapter's pool")
        assert registry.served_models() == ["chat", "sql"]  # in place: the others stay
