"""Static discovery keeps asking replicas named by URL alone which models they serve: one
restarted under another name moves to that name's pool, and one that stops answering keeps
the names it told."""

from __future__ import annotations

import asyncio

import httpx

from conveyor.gateway.pool import Registry
from conveyor.gateway.routing import make_policy
from conveyor.gateway.static_discovery import StaticDiscovery


def test_a_replica_renamed_moves_pool_and_a_silent_one_keeps_its_names() -> None:
    answer: dict[str, object] = {"names": ["first"]}

    def models(request: httpx.Request) -> httpx.Response:
        if answer["names"] is None:
            return httpx.Response(503, json={"error": {"message": "loading"}})
        data = [{"id": n, "object": "model"} for n in answer["names"]]  # type: ignore[attr-defined]
        return httpx.Response(200, json={"object": "list", "data": data})

    async def run() -> list[list[str]]:
        registry = Registry(
            lambda name: make_policy("round-robin", bounded_load_factor=1.25, ring_vnodes=10)
        )
        async with httpx.AsyncClient(transport=httpx.MockTransport(models)) as client:
            discovery = StaticDiscovery(
                registry=registry,
                client=client,
                backends=("http://replica:8000",),
                backends_file=None,
                interval_s=0.0,  # every sync asks again
                timeout_s=1.0,
                backend_api_key=None,
            )
            seen = []
            for names in (["first"], ["second"], None, ["second", "third"]):
                answer["names"] = names
                await discovery.sync_once()
                seen.append(registry.served_models())
            return seen

    assert asyncio.run(run()) == [["first"], ["second"], ["second"], ["second", "third"]]
