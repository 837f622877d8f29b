"""A Conveyor replica says its load in the ``x-conveyor-load`` header of every API response;
the gateway takes it as a /load poll's answer, does not poll a replica it heard from lately
(unless it was ejected since), and keeps the header from the client. A replica without the header (vLLM,
SGLang) is polled as before."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from loopback import serve

from conveyor.contracts.load import LOAD_HEADER, ReplicaLoad
from conveyor.gateway.load_poller import LoadPoller
from conveyor.gateway.metrics import GatewayMetrics
from conveyor.gateway.pool import Registry
from conveyor.gateway.round_robin import RoundRobin
from conveyor.gateway.settings import GatewaySettings
from conveyor.gateway.upstream_attempt import Upstream, UpstreamRequest

POLL_LOAD = ReplicaLoad(0, 0, 0.0, 8, None, True)
"""What /load says: idle."""
HEADER_LOAD = ReplicaLoad(5, 3, 0.42, 8, 16, True, model="m-ü", in_flight=8)
"""What a response's header says: busy (a model name that is not ASCII stays out of it)."""


def test_the_header_round_trips_without_the_model_name() -> None:
    value = HEADER_LOAD.to_header()
    value.decode("ascii")
    back = ReplicaLoad.from_header(value)
    assert back == ReplicaLoad(5, 3, 0.42, 8, 16, True, model=None, in_flight=8)
    for bad in (b"", b"not json", b"[1]", b'{"running": "x"}'):
        with pytest.raises(ValueError):
            ReplicaLoad.from_header(bad)


@pytest.mark.parametrize("sends_header", [True, False], ids=["conveyor", "no-header"])
def test_a_replica_heard_through_its_responses_is_not_polled(sends_header: bool) -> None:
    max_age = 0.5

    async def replica(request: web.Request) -> web.Response:
        if request.path == "/load":
            return web.json_response(POLL_LOAD.to_json())
        headers = {LOAD_HEADER: HEADER_LOAD.to_header().decode()} if sends_header else {}
        return web.json_response({"ok": True}, headers=headers)

    async def run() -> tuple[list[dict[str, Any]], ReplicaLoad | None, list[bool]]:
        async with contextlib.AsyncExitStack() as stack:
            url = await stack.enter_async_context(serve(replica))
            registry = Registry(lambda _name: RoundRobin())
            registry.sync("test", {"m": {url}})
            session = await stack.enter_async_context(aiohttp.ClientSession())
            metrics = GatewayMetrics()
            poller = LoadPoller(
                registry=registry, session=session, metrics=metrics, interval_s=0.2,
                timeout_s=1.0, backend_api_key=None, heard_max_age_s=max_age,
            )  # fmt: skip
            upstream = Upstream(session=session, metrics=metrics, settings=GatewaySettings())
            upstream.load_heard = poller.heard_in_response
            pool, rep = registry.pools["m"], registry.replicas[url]
            loop = asyncio.get_running_loop()
            due = [bool(poller.due(loop.time()))]  # joined: polled at once
            await poller._poll(rep)
            sent: list[dict[str, Any]] = []

            async def send(message: dict[str, Any]) -> None:
                sent.append(message)

            for _ in range(3):
                request = UpstreamRequest("/v1/completions", b"{}", {}, False, 0.0)
                assert await upstream.attempt(pool, rep, request, send) is None
            now = loop.time()
            due += [bool(poller.due(now)), bool(poller.due(now + max_age))]
            rep.eject(now, 5.0)  # an ejected replica is polled to be let back in
            due.append(bool(poller.due(now)))
            return sent, rep.load, due

    sent, load, due = asyncio.run(run())
    heads = [m for m in sent if m["type"] == "http.response.start"]
    assert len(heads) == 3
    assert all(LOAD_HEADER.encode() not in dict(m["headers"]) for m in heads)
    if sends_header:
        assert load is not None and (load.running, load.waiting, load.kv_cache_usage) == (
            5,
            3,
            0.42,
        )
        assert due == [True, False, True, True]
    else:
        assert load == POLL_LOAD
        assert due == [True, True, True, True]
