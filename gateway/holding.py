"""Scale from zero at the gateway: a request for a model with no ready replica is held until
one says ready.

Held requests are counted in ``conveyor_gateway_pending_requests{model}``, which the
operator's autoscaler scrapes to start a replica for a model scaled to zero.
"""

from __future__ import annotations

import asyncio

from conveyor.gateway.errors import Failure
from conveyor.gateway.metrics import GatewayMetrics
from conveyor.gateway.pool import Pool, Registry
from conveyor.gateway.settings import GatewaySettings


class Holding:
    """Holds requests while their model has no ready replica, within the gateway's bounds
    (``--hold-timeout``, ``--max-held-requests``)."""

    def __init__(
        self, *, registry: Registry, metrics: GatewayMetrics, settings: GatewaySettings
    ) -> None:
        self._registry = registry
        self._metrics = metrics
        self._s = settings

    async def until_ready(self, pool: Pool, arrival: float) -> Failure | None:
        """None once a replica of ``pool`` is ready; a 503 when ``--hold-timeout`` passed
        since ``arrival``, the model went away, or ``--max-held-requests`` are already held
        for it."""
        retry_after = str(self._s.retry_after_s).encode()
        if pool.held >= self._s.max_held_requests:
            return Failure(
                503,
                f"no ready replica for model {pool.model!r} and {pool.held} requests already "
                "waiting for one; retry later",
                retry_after,
            )
        loop = asyncio.get_running_loop()
        deadline = arrival + self._s.hold_timeout_s
        pending = self._metrics.pending.labels(pool.model)
        pending.inc()
        pool.held += 1
        try:
            while True:
                changed = self._registry.changed()
                if pool.has_ready():
                    return None
                remaining = deadline - loop.time()
                if remaining <= 0 or self._registry.pools.get(pool.model) is not pool:
                    break
                try:
                    await asyncio.wait_for(changed.wait(), remaining)
                except TimeoutError:
                    if pool.has_ready():
                        return None
                    break
        finally:
            pending.dec()
            pool.held -= 1
        return Failure(
            503,
            f"no ready replica for model {pool.model!r} after waiting "
            f"{self._s.hold_timeout_s:g} s; retry later",
            retry_after,
        )
