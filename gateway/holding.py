"""Requests held at the gateway.

- Scale from zero: a request for a model with no ready replica is held until one says ready.
- Queueing at the gateway (``--queue-at-gateway``, as Knative's activator and llm-d's flow
  control): while every ready replica has its batch full and ``--replica-queue`` requests
  waiting, a request is held here, by its ``priority`` (vLLM's field: lower first) and then
  in arrival order, and goes to the first replica with room.
  A replica that is added then (a scale-up) takes the first held requests at once, where without
  it they would wait in the queue of the replica they were sent to while the new one idles.

Held requests are counted in ``conveyor_gateway_pending_requests{model}``, which the
operator's autoscaler scrapes as backlog (and to start a replica for a model scaled to zero).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib

from conveyor.gateway.errors import Failure
from conveyor.gateway.metrics import GatewayMetrics
from conveyor.gateway.pool import Pool, Registry
from conveyor.gateway.routing import LoadView
from conveyor.gateway.settings import GatewaySettings


class Holding:
    """Holds requests while their model has no ready replica, or no replica with room, within
    the gateway's bounds (``--hold-timeout``, ``--max-held-requests``)."""

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

    def view(self) -> LoadView:
        """Load as of now, with the room a replica is given when queueing at the gateway."""
        queue = self._s.replica_queue if self._s.queue_at_gateway else None
        return LoadView(asyncio.get_running_loop().time(), self._s.load_stale_after_s, queue)

    async def until_room(self, pool: Pool, arrival: float, priority: int = 0) -> Failure | None:
        """None at once unless requests are already held for room or every ready replica is
        full; else None when this request is the first held (by ``priority``, lower first,
        then arrival) and a replica has room. A 429
        when as many are held as the replicas' queue bounds add up to (or
        ``--max-held-requests``), a 503 when ``--hold-timeout`` passed since ``arrival``.

        Only the first request looks for room: when a request of the pool ends here
        (``room_freed``), when replicas come, go or turn ready, and each load poll interval,
        since other gateways' requests end too. Once it has gone, the next looks at once: the one gone has
        its replica's in-flight count raised by then (``Upstream.attempt`` does it before
        its first wait), so no more are let go than there is room for.
        """
        if not self._s.queue_at_gateway:
            return None
        view = self.view()
        if not pool.queue and not pool.saturated(view):
            return None
        bound = pool.queue_bound(view, self._s.max_held_requests)
        if len(pool.queue) >= bound:
            if pool.queue[-1][0] <= priority:  # nobody held would come after this one
                return self._queue_full(pool)
            _, number, event = pool.queue.pop()  # the last in order gives way, as vLLM's
            pool.bumped.add(number)  # priority scheduling preempts the last in its order
            event.set()
        loop = asyncio.get_running_loop()
        deadline = arrival + self._s.hold_timeout_s
        turn = asyncio.Event()
        entry = (priority, next(pool.arrivals), turn)
        bisect.insort(pool.queue, entry)  # (priority, number) are unique: events never compared
        if not pool.saturated(view):
            pool.queue[0][2].set()  # room already: the first need not wait for its next look
        pending = self._metrics.pending.labels(pool.model)
        pending.inc()
        pool.held += 1
        try:
            while True:
                if entry[1] in pool.bumped:
                    pool.bumped.discard(entry[1])
                    return self._queue_full(pool, bumped=True)
                first = pool.queue[0] is entry
                if first and pool.has_ready() and not pool.saturated(self.view()):
                    return None
                remaining = deadline - loop.time()
                if remaining <= 0 or self._registry.pools.get(pool.model) is not pool:
                    break
                turn.clear()
                if first:  # a replica that becomes ready (or goes) wakes the first too
                    self._registry.wake_on_change(turn)
                timeout = min(remaining, self._s.load_poll_interval_s) if first else remaining
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(timeout):
                        await turn.wait()
        finally:
            self._registry.forget_wake(turn)
            pool.bumped.discard(entry[1])
            at = bisect.bisect_left(pool.queue, entry[:2], key=lambda e: e[:2])
            if at < len(pool.queue) and pool.queue[at] is entry:  # not bumped out already
                del pool.queue[at]
                if at == 0 and pool.queue:
                    pool.queue[0][2].set()
            pending.dec()
            pool.held -= 1
        return Failure(
            503,
            f"every replica of model {pool.model!r} stayed busy for "
            f"{self._s.hold_timeout_s:g} s; retry later",
            str(self._s.retry_after_s).encode(),
        )

    def _queue_full(self, pool: Pool, bumped: bool = False) -> Failure:
        why = (
            "this request gave way to one of a lower priority value"
            if bumped
            else ("every replica is busy")
        )
        return Failure(
            429,
            f"{why} and {len(pool.queue)} requests already wait at the gateway for model "
            f"{pool.model!r}; retry later",
            str(self._s.retry_after_s).encode(),
            code="queue_full",
        )

    @staticmethod
    def room_freed(pool: Pool) -> None:
        """A request of ``pool`` ended here: the first held one looks for room now."""
        if pool.queue:
            pool.queue[0][2].set()
