"""Kubernetes discovery's event handling, with fake list/watch results at the SliceSource boundary."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from conveyor.gateway.k8s_discovery import (
    BACKOFF_INITIAL_S,
    EndpointSliceTracker,
    K8sPoolSpec,
    KubernetesDiscovery,
    endpoint_urls,
)
from conveyor.gateway.pool import Registry
from conveyor.gateway.routing import make_policy


def endpoint_slice(
    name: str, *addresses: str, ready: bool | None = True, port: int = 8000
) -> dict[str, Any]:
    conditions = {} if ready is None else {"ready": ready}
    return {
        "metadata": {"name": name, "resourceVersion": "1"},
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
        "endpoints": [{"addresses": [a], "conditions": conditions} for a in addresses],
    }


def test_endpoint_urls_take_ready_endpoints_and_the_named_port() -> None:
    assert endpoint_urls(endpoint_slice("a", "10.0.0.1", "10.0.0.2"), None) == {
        "http://10.0.0.1:8000", "http://10.0.0.2:8000",
    }  # fmt: skip
    assert endpoint_urls(endpoint_slice("a", "10.0.0.1", ready=False), None) == set()
    assert endpoint_urls(endpoint_slice("a", "10.0.0.1", ready=None), None) == {
        "http://10.0.0.1:8000"
    }
    assert endpoint_urls(endpoint_slice("a", "fd00::1"), "http") == {"http://[fd00::1]:8000"}
    assert endpoint_urls(endpoint_slice("a", "10.0.0.1"), "metrics") == set()
    assert (
        endpoint_urls({"metadata": {"name": "a"}, "endpoints": None, "ports": None}, None) == set()
    )


def test_endpoint_urls_drop_terminating_endpoints() -> None:
    """A pod that is shutting down gets no new requests, even where its slice says ready."""
    slice_ = endpoint_slice("a", "10.0.0.1", "10.0.0.2")
    slice_["endpoints"][1]["conditions"] = {"ready": True, "terminating": True}
    assert endpoint_urls(slice_, "http") == {"http://10.0.0.1:8000"}


def test_tracker_follows_slices_being_added_changed_and_deleted() -> None:
    tracker = EndpointSliceTracker(None)
    tracker.reset([endpoint_slice("a", "10.0.0.1")])
    tracker.apply("ADDED", endpoint_slice("b", "10.0.0.2"))
    assert tracker.urls() == {"http://10.0.0.1:8000", "http://10.0.0.2:8000"}
    tracker.apply("MODIFIED", endpoint_slice("a", "10.0.0.1", ready=False))
    # as the apiserver sends it (allowWatchBookmarks): no name, only the resourceVersion
    tracker.apply("BOOKMARK", {"kind": "EndpointSlice", "metadata": {"resourceVersion": "9"}})
    assert tracker.urls() == {"http://10.0.0.2:8000"}
    tracker.apply("DELETED", endpoint_slice("b"))
    assert tracker.urls() == set()


class FakeSlices:
    """Scripted list results and watch streams; a watch ends (or breaks) as the test says."""

    def __init__(self) -> None:
        self.lists: asyncio.Queue[list[dict[str, Any]] | Exception] = asyncio.Queue()
        self.events: asyncio.Queue[tuple[str, dict[str, Any]] | Exception | None] = asyncio.Queue()
        self.list_calls = 0

    async def list(self, namespace: str, selector: str) -> tuple[list[dict[str, Any]], str]:
        assert (namespace, selector) == ("ns", "conveyor.dev/llmservice=chat")
        self.list_calls += 1
        result = await self.lists.get()
        if isinstance(result, Exception):
            raise result
        return result, str(self.list_calls)

    async def watch(
        self, namespace: str, selector: str, resource_version: str
    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        while True:
            event = await self.events.get()
            if event is None:
                return
            if isinstance(event, Exception):
                raise event
            yield event


class NoNetwork(httpx.AsyncBaseTransport):
    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        raise AssertionError(f"discovery must not call {request.url} when the model is given")


async def until(condition, what: str) -> None:
    async with asyncio.timeout(5):
        while not condition():
            await asyncio.sleep(0)  # yield to the discovery task; bounded by the timeout
    assert condition(), what


async def test_watch_events_update_the_pool_and_a_broken_watch_relists_with_backoff() -> None:
    registry = Registry(
        lambda name: make_policy(name or "prefix-aware", bounded_load_factor=1.25, ring_vnodes=10)
    )
    fake = FakeSlices()
    sleeps: list[float] = []

    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)

    async with httpx.AsyncClient(transport=NoNetwork()) as client:
        discovery = KubernetesDiscovery(
            registry=registry,
            source=fake,
            client=client,
            timeout_s=1.0,
            backend_api_key=None,
            sleep=sleep,
        )
        spec = K8sPoolSpec("ns", "conveyor.dev/llmservice=chat", model="chat", policy="least-load")
        discovery.add_pool(spec)
        await fake.lists.put([endpoint_slice("chat-1", "10.0.0.1")])
        await until(discovery.synced.is_set, "first list")
        pool = registry.pools["chat"]
        assert list(pool.replicas) == ["http://10.0.0.1:8000"]
        assert pool.policy.name == "least-load"

        await fake.events.put(("ADDED", endpoint_slice("chat-2", "10.0.0.2")))
        await until(lambda: len(pool.replicas) == 2, "second replica joins")
        await fake.events.put(("MODIFIED", endpoint_slice("chat-1", "10.0.0.1", ready=False)))
        await until(lambda: list(pool.replicas) == ["http://10.0.0.2:8000"], "first replica leaves")

        # The watch breaks, the apiserver is away once, then the list shows what changed meanwhile.
        await fake.events.put(ConnectionResetError("watch dropped"))
        await fake.lists.put(OSError("apiserver unreachable"))
        await fake.lists.put([endpoint_slice("chat-3", "10.0.0.3")])
        await until(
            lambda: list(pool.replicas) == ["http://10.0.0.3:8000"], "relist after reconnect"
        )
        assert sleeps == [BACKOFF_INITIAL_S, BACKOFF_INITIAL_S * 2]
        assert fake.list_calls == 3

        # A watch that ends normally (server-side timeout) relists at once, without backoff.
        await fake.events.put(None)
        await fake.lists.put([])
        await until(lambda: not pool.replicas, "empty pool after relist")
        assert "chat" in registry.pools  # known model, no replica: 503 rather than 404
        assert len(sleeps) == 2

        await discovery.close()
        assert "chat" not in registry.pools


async def test_model_is_learned_from_a_replica_when_not_given() -> None:
    def models(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/models"
        return httpx.Response(200, json={"object": "list", "data": [{"id": "tiny"}]})

    registry = Registry(
        lambda name: make_policy(name or "round-robin", bounded_load_factor=1.25, ring_vnodes=10)
    )
    fake = FakeSlices()
    async with httpx.AsyncClient(transport=httpx.MockTransport(models)) as client:
        discovery = KubernetesDiscovery(
            registry=registry, source=fake, client=client, timeout_s=1.0, backend_api_key=None
        )
        discovery.add_pool(K8sPoolSpec("ns", "conveyor.dev/llmservice=chat"))
        await fake.lists.put([endpoint_slice("s", "10.0.0.1")])
        await until(lambda: "tiny" in registry.pools, "model learned")
        await discovery.close()


@pytest.fixture(autouse=True)
def _no_kubernetes_client(monkeypatch: pytest.MonkeyPatch) -> None:
    """The raw client below the boundary must never be reached from these tests."""
    from kubernetes_asyncio import client

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("unit tests must not talk to a Kubernetes API")

    monkeypatch.setattr(client.DiscoveryV1Api, "__init__", refuse)
