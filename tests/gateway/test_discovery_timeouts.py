"""The discovery's real Kubernetes sources against an apiserver that stops answering (frozen,
or partitioned away): no list or watch waits on its socket forever, and the pool is listed
again once the apiserver answers, so what changed meanwhile reaches the routing table.

A small aiohttp app on loopback plays the apiserver: each list answers from a script or hangs;
each watch sends its headers and then nothing, as a frozen apiserver does.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from aiohttp import web

from conveyor.gateway.k8s_discovery import (
    ApiTimeouts,
    K8sPoolSpec,
    KubernetesDiscovery,
    KubernetesSliceSource,
)
from conveyor.gateway.llmservice_discovery import KubernetesLLMServiceSource
from conveyor.gateway.pool import Registry
from conveyor.gateway.routing import make_policy

SHORT = ApiTimeouts(list_s=1.0, connect_s=1.0, watch_idle_s=0.3)
"""Bounds short enough for a test (the defaults are tens of seconds), long enough for an answer
on a busy machine."""
HANG = "hang"


class SilentApiserver:
    """Lists answer from ``lists`` (a slice list, or HANG: no answer at all); every watch sends
    its headers, then nothing."""

    def __init__(self) -> None:
        self.lists: list[list[dict[str, Any]] | str] = []
        self.list_calls = 0
        self.watch_calls = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.query.get("watch") in ("true", "1", "True"):
            self.watch_calls += 1
            response = web.StreamResponse(headers={"Content-Type": "application/json"})
            await response.prepare(request)
            await asyncio.Event().wait()  # frozen: the stream stays open and silent
        self.list_calls += 1
        script = self.lists.pop(0) if self.lists else HANG
        if script == HANG:
            await asyncio.Event().wait()
        return web.json_response(
            {"kind": "List", "metadata": {"resourceVersion": str(self.list_calls)}, "items": script}
        )


@pytest.fixture
async def apiserver() -> AsyncIterator[tuple[SilentApiserver, Any]]:
    from kubernetes_asyncio import client

    fake = SilentApiserver()
    app = web.Application()
    app.router.add_route("GET", "/{tail:.*}", fake.handle)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    configuration = client.Configuration(host=f"http://127.0.0.1:{port}")
    api_client = client.ApiClient(configuration)
    try:
        yield fake, api_client
    finally:
        await api_client.close()
        await runner.cleanup()


def endpoint_slice(name: str, address: str) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "resourceVersion": "1"},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}],
        "endpoints": [{"addresses": [address], "conditions": {"ready": True}}],
    }


async def test_a_list_that_gets_no_answer_times_out(
    apiserver: tuple[SilentApiserver, Any],
) -> None:
    fake, api_client = apiserver
    slices = KubernetesSliceSource(api_client, SHORT)
    llmservices = KubernetesLLMServiceSource(api_client, SHORT)
    async with asyncio.timeout(10):  # the test's own bound: far above the sources' own
        with pytest.raises(TimeoutError):
            await slices.list("ns", "app=chat")
        with pytest.raises(TimeoutError):
            await llmservices.list("ns")
    assert fake.list_calls >= 1  # the client may give up before its request is even read


async def test_a_silent_watch_is_given_up(apiserver: tuple[SilentApiserver, Any]) -> None:
    fake, api_client = apiserver
    slices = KubernetesSliceSource(api_client, SHORT)
    llmservices = KubernetesLLMServiceSource(api_client, SHORT)
    async with asyncio.timeout(10):
        with pytest.raises(TimeoutError):
            async for _ in slices.watch("ns", "app=chat", "1"):
                pass
        with pytest.raises(TimeoutError):
            async for _ in llmservices.watch("ns", "1"):
                pass
    assert fake.watch_calls >= 1


async def test_after_a_frozen_apiserver_the_pool_is_listed_again(
    apiserver: tuple[SilentApiserver, Any],
) -> None:
    """List (one replica) -> the watch goes silent -> a list hangs -> the next list answers
    with what changed meanwhile: the pool follows it, without any event ever arriving."""
    fake, api_client = apiserver
    fake.lists = [
        [endpoint_slice("chat-1", "10.0.0.1")],
        HANG,
        [endpoint_slice("chat-2", "10.0.0.2")],
    ]
    registry = Registry(
        lambda name: make_policy(name or "least-load", bounded_load_factor=1.25, ring_vnodes=10)
    )
    sleeps: list[float] = []

    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)

    async with httpx.AsyncClient() as client:
        discovery = KubernetesDiscovery(
            registry=registry,
            source=KubernetesSliceSource(api_client, SHORT),
            client=client,
            timeout_s=1.0,
            backend_api_key=None,
            sleep=sleep,
        )
        discovery.add_pool(K8sPoolSpec("ns", "app=chat", model="chat", port_name="http"))
        try:
            async with asyncio.timeout(10):
                await discovery.synced.wait()
                assert list(registry.pools["chat"].replicas) == ["http://10.0.0.1:8000"]
                while list(registry.pools["chat"].replicas) != ["http://10.0.0.2:8000"]:
                    await asyncio.sleep(0.01)
        finally:
            await discovery.close()
    assert fake.list_calls >= 3
    assert len(sleeps) >= 2  # the silent watch, then the hung list: each failed, then backed off
