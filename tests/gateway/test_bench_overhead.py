"""``conveyor bench gateway --part overhead`` against a path that breaks: a held stream
refused, or a probe that fails, is the path's result (counted as broken, by kind), not the
end of the bench."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web
from aiohttp.test_utils import TestServer

from conveyor.bench.gateway.overhead import probe_under_load


class _FlakyReplica:
    """Refuses every other held stream (the ``pace`` ones) with a 503, and every fourth
    probe; answers the rest as the stub does: a stream of chunks, or a whole answer. Held
    streams stay open until the client leaves."""

    def __init__(self) -> None:
        self.seen = 0
        self.never = asyncio.Event()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        doc = json.loads(await request.read())
        held = str(doc["prompt"]).startswith("pace")
        self.seen += 1
        if (held and self.seen % 2) or (not held and self.seen % 4 == 0):
            return web.json_response({"error": {"message": "busy"}}, status=503)
        if not doc["stream"]:
            return web.json_response({"choices": [{"text": "x"}]})
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices": [{"text": "x"}]}\n\n')
        if held:
            await self.never.wait()
        await response.write(b"data: [DONE]\n\n")
        return response


async def test_refused_streams_and_failed_probes_count_as_broken_not_as_the_bench_failing() -> None:
    app = web.Application()
    app.router.add_post("/v1/completions", _FlakyReplica().handle)
    async with TestServer(app) as server:
        url = str(server.make_url("")).rstrip("/")
        probes = await probe_under_load(url, background=6, probes=8)
    assert probes.errors["held stream: HTTP 503"] == 3
    failed_probes = probes.errors["probe: HTTP 503"]
    assert 0 < failed_probes < 16
    assert len(probes.whole) + len(probes.ttft) == 16 - failed_probes
    assert len(probes.ttft) == len(probes.e2e)
    assert probes.broken == 3 + failed_probes
