"""A replica's HTTP answers from a handler, on a loopback port: what the load poller's tests
talk to over a real socket (the poller's own client, aiohttp, is not mocked)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web


@contextlib.asynccontextmanager
async def serve(
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]], port: int = 0
) -> AsyncIterator[str]:
    """``handler`` answers every path on 127.0.0.1 (``port``, or one the system picks);
    yields the base URL."""
    app = web.Application()
    app.router.add_route("*", "/{path:.*}", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", port)
        await site.start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()
