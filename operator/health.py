"""``/healthz`` and ``/metrics`` on port 8081 (aiohttp, which kopf already brings)."""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from conveyor.operator.metrics import OperatorMetrics


class HealthServer:
    """Answers the kubelet's probes and Prometheus; ``start()``/``stop()``."""

    def __init__(
        self, *, host: str, port: int, metrics: OperatorMetrics, healthy: Callable[[], str | None]
    ) -> None:
        self.host = host
        self.port = port
        self.metrics = metrics
        self.healthy = healthy
        """None when healthy, else why not (a standby waiting for the Lease is healthy)."""
        self._runner: web.AppRunner | None = None

    async def _healthz(self, request: web.Request) -> web.Response:
        problem = self.healthy()
        if problem is None:
            return web.json_response({"status": "ok"})
        return web.json_response({"status": problem}, status=503)

    async def _metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        if self.port == 0:  # an ephemeral port (tests): report the one bound
            self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
