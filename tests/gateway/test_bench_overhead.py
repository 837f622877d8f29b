"""``conveyor bench gateway --part overhead`` against a path that breaks: a held stream
refused, or a probe that fails, is the path's result (counted as broken, by kind), not the
end of the bench."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web
from aiohttp.test_utils import TestServer

from conveyor.bench.gateway.overhead import Probes, probe_under_load


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


async def _probe(replica: _FlakyReplica | _SilentReplica, background: int, probes: int) -> Probes:
    """``probe_under_load`` against ``replica``, whose held handlers are let go afterwards."""
    app = web.Application()
    app.router.add_post("/v1/completions", replica.handle)
    async with TestServer(app) as server:
        url = str(server.make_url("")).rstrip("/")
        try:
            return await probe_under_load(url, background=background, probes=probes)
        finally:
            replica.never.set()


async def test_refused_streams_and_failed_probes_count_as_broken_not_as_the_bench_failing() -> None:
    probes = await _probe(_FlakyReplica(), background=6, probes=8)
    # the six held streams come first (1-6, the odd ones refused), then the 16 probes in
    # turn, whole (7, 9, ...) and streamed (8, 10, ...), every fourth refused: 8, 12, 16, 20
    assert probes.errors == {"held stream: HTTP 503": 3, "probe: HTTP 503": 4}
    assert (len(probes.whole), len(probes.ttft), len(probes.e2e)) == (8, 4, 4)
    assert probes.broken == 7


class _SilentReplica:
    """Never answers a held stream (no headers); answers probes at once."""

    def __init__(self) -> None:
        self.never = asyncio.Event()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        doc = json.loads(await request.read())
        if str(doc["prompt"]).startswith("pace"):
            await self.never.wait()
        return web.json_response({"choices": [{"text": "x"}]})


async def test_held_streams_that_never_open_are_counted_once(monkeypatch) -> None:
    from conveyor.bench.gateway import overhead

    monkeypatch.setattr(overhead, "OPEN_TIMEOUT_S", 0.3)
    probes = await _probe(_SilentReplica(), background=3, probes=2)
    # each of the three counted once, whether its own read timed out or the wait for all
    # of them to open did first
    held = {kind: n for kind, n in probes.errors.items() if kind.startswith("held stream")}
    assert sum(held.values()) == 3, probes.errors
    assert len(probes.whole) == 2
