"""The node agent's pod watch against an apiserver that goes silent (frozen, or partitioned
away: nothing is closed): it is given up after ``idle_s`` with no event, so the agent lists the
pods again instead of waiting on its socket for ever. The apiserver sends a bookmark each
minute on a quiet watch, so a healthy one never stays silent that long."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest
from aiohttp import web

from conveyor.cluster.agent_api import AsyncApi
from conveyor.cluster.api import Credentials


@pytest.fixture
async def silent_watch_server() -> AsyncIterator[str]:
    """Each watch gets its headers and one bookmark, then nothing."""

    async def watch(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        await response.write(b'{"type":"BOOKMARK","object":{"metadata":{"resourceVersion":"7"}}}\n')
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    app = web.Application()
    app.router.add_get("/api/v1/pods", watch)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def test_a_silent_pod_watch_is_given_up(silent_watch_server: str) -> None:
    api = AsyncApi(Credentials(server=silent_watch_server, ca_file=None))
    events = []
    try:
        async with asyncio.timeout(10):  # the test's own bound: far above idle_s
            with pytest.raises(httpx.ReadTimeout):
                async for event in api.watch(
                    "/api/v1/pods", {"resourceVersion": "1"}, 300, idle_s=0.3
                ):
                    events.append(event["type"])
    finally:
        await api.aclose()
    assert events == ["BOOKMARK"]
