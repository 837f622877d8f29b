"""Pools and the registry of replicas.

A pool is what a model name routes to: (model, routing policy, replicas). Discovery sources
(static backends, a Kubernetes EndpointSlice watch, later one watch per LLMService) each
report the full membership they know, ``model -> set of URLs``; the registry takes the
union over sources. A replica is one object per URL however many pools list it, so its load
and in-flight count are shared.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
from collections.abc import Callable, Mapping, Set

from conveyor.contracts.engine_load import NO_LIMITS, Limits
from conveyor.gateway.prefix_key import RouteRequest
from conveyor.gateway.replica import Replica
from conveyor.gateway.routing import Decision, LoadView, RoutingPolicy

log = logging.getLogger("conveyor.gateway")


class NoCandidate(enum.Enum):
    """Why a pool has no replica to try."""

    NONE_READY = "no replica said ready"
    QUEUES_FULL = "every replica that could be tried has a full queue"


class Pool:
    def __init__(self, model: str, policy: RoutingPolicy) -> None:
        self.model = model
        self.policy = policy
        self.replicas: dict[str, Replica] = {}
        """Members in the order they joined (round-robin walks this order)."""
        self.held = 0
        """Requests held at the gateway: waiting for a ready replica (scale from zero), or
        for room on one (``--queue-at-gateway``)."""
        self.queue: list[tuple[int, int, asyncio.Event]] = []
        """Requests waiting for room on a replica, as (priority, arrival number, event),
        sorted: the lowest ``priority`` first, then the oldest. The first's event is set when
        it should look again (``Holding.until_room``)."""
        self.arrivals = itertools.count()
        """Numbers the held requests in arrival order."""
        self.bumped: set[int] = set()
        """Arrival numbers of held requests taken out of a full ``queue`` for one that comes
        first in its order (a lower ``priority``): each is answered a 429 when it wakes."""

    def has_ready(self) -> bool:
        """Whether any replica said ready in its last /load poll (ejected ones included: panic
        mode tries those rather than refuse)."""
        return any(r.load is not None and r.load.ready for r in self.replicas.values())

    def choose(
        self, request: RouteRequest, view: LoadView, tried: Set[str]
    ) -> Decision | NoCandidate:
        """A replica that may be tried for ``request``, by the pool's policy, none of ``tried``.

        The policy picks among the admitted replicas (ready, not ejected) whose queue is not
        full. In panic mode, when every replica is ejected (as Envoy's: every ejection is a
        guess gone wrong), those whose last /load poll said ready are tried rather than
        refusing the request. A response that continues a stored one goes to the replica
        that stores it, or to none (a full queue, or not ready or tried: retry later) while
        that replica is in the pool; once it has gone, the policy's pick answers the 404.
        """
        admitted = self._admitted(view, tried)
        candidates = [r for r in admitted if not r.queue_full(view.now, view.stale_after)]
        if (tag := request.response_tag) is not None:
            holder = next((r for r in self.replicas.values() if r.tag == tag), None)
            if holder in candidates:
                return Decision(holder, "response_affinity")
            if holder is not None:
                return NoCandidate.QUEUES_FULL if holder in admitted else NoCandidate.NONE_READY
        if candidates:
            if view.replica_queue is not None:  # queueing at the gateway: room first
                candidates = [r for r in candidates if view.has_room(r)] or candidates
            return self.policy.choose(candidates, request, view)
        return NoCandidate.QUEUES_FULL if admitted else NoCandidate.NONE_READY

    def _admitted(self, view: LoadView, tried: Set[str] = frozenset()) -> list[Replica]:
        untried = [r for r in self.replicas.values() if r.url not in tried]
        admitted = [r for r in untried if r.admitted(view.now)]
        return admitted or [r for r in untried if r.load is not None and r.load.ready]

    def orders_by_priority(self) -> bool:
        """Whether the replicas read ``priority`` as the gateway orders held requests by it,
        lower first (Conveyor and vLLM); SGLang's default ignores it, and runs higher values
        first where it reads it, so a pool with an SGLang replica holds by arrival alone."""
        return not any(
            r.load is not None and r.load.engine == "sglang" for r in self.replicas.values()
        )

    def saturated(self, view: LoadView) -> bool:
        """Every replica a request could go to is ready but has no room for one more
        (``view.replica_queue``); False with none ready (that is ``has_ready``'s wait)."""
        admitted = self._admitted(view)
        return bool(admitted) and not any(view.has_room(r) for r in admitted)

    def queue_bound(self, view: LoadView, default: int) -> int:
        """Most requests to hold for room: what the ready replicas' own queue bounds add up
        to where each has one (past it they would answer 429 themselves), else ``default``."""
        bounds = [r.load.max_queued_requests for r in self._admitted(view) if r.load is not None]
        if bounds and all(b is not None for b in bounds):
            return min(default, sum(b for b in bounds if b is not None))
        return default

    def set_replicas(self, replicas: list[Replica]) -> None:
        self.replicas = {replica.url: replica for replica in replicas}
        set_members = getattr(self.policy, "set_members", None)
        if set_members is not None:
            set_members(frozenset(self.replicas))


class Registry:
    """Every pool and replica the gateway knows; changed only by discovery, on the event loop."""

    def __init__(self, policy_factory: Callable[[str | None], RoutingPolicy]) -> None:
        self._policy_factory = policy_factory
        self.pools: dict[str, Pool] = {}
        self.replicas: dict[str, Replica] = {}
        self._sources: dict[str, dict[str, set[str]]] = {}
        self._policies: dict[str, str | None] = {}
        self._source_limits: dict[str, dict[str, Limits]] = {}
        self._url_limits: dict[str, Limits] = {}
        self.listeners: list[Callable[[list[Replica], list[Replica]], None]] = []
        """Called with (added, removed) replicas after every change."""
        self._changed = asyncio.Event()
        self._wake: set[asyncio.Event] = set()

    def changed(self) -> asyncio.Event:
        """An event set at the next change of membership or readiness: take it, check what you
        wait for, then wait on it (no wake-up is lost in between)."""
        return self._changed

    def notify(self) -> None:
        """A replica became ready, or pools changed: wake everything waiting on ``changed()``
        and set the events given to ``wake_on_change``."""
        event, self._changed = self._changed, asyncio.Event()
        event.set()
        woken, self._wake = self._wake, set()
        for turn in woken:
            turn.set()

    def wake_on_change(self, turn: asyncio.Event) -> None:
        """Set ``turn`` at the next change (once)."""
        self._wake.add(turn)

    def forget_wake(self, turn: asyncio.Event) -> None:
        """``turn`` no longer waits (it went, or gave up)."""
        self._wake.discard(turn)

    def sync(
        self,
        source: str,
        members: Mapping[str, set[str]],
        policies: Mapping[str, str | None] | None = None,
        limits: Mapping[str, Limits] | None = None,
    ) -> None:
        """Replace everything ``source`` knows with ``members`` (model -> replica URLs).

        A model listed with no URLs keeps its pool (known model, no replica: 503, not 404).
        ``policies`` names a pool's routing policy; None means the gateway's default.
        ``limits`` are the batch and queue bounds of the replicas ``source`` lists for a model
        (``limits_of``).
        """
        self._source_limits[source] = dict(limits or {})
        self._sources[source] = {model: set(urls) for model, urls in members.items()}
        for model, policy in (policies or {}).items():
            if self._policies.get(model) != policy and model in self.pools:
                self.pools[model].policy = self._policy_factory(policy)
            self._policies[model] = policy
        self._rebuild()

    def forget(self, source: str) -> None:
        self._sources.pop(source, None)
        self._source_limits.pop(source, None)
        self._rebuild()

    def _rebuild(self) -> None:
        wanted: dict[str, set[str]] = {}
        for members in self._sources.values():
            for model, urls in members.items():
                wanted.setdefault(model, set()).update(urls)

        self._url_limits = {}
        for source in sorted(self._sources):
            for model, urls in sorted(self._sources[source].items()):
                limits = self._source_limits.get(source, {}).get(model, NO_LIMITS)
                if limits != NO_LIMITS:  # a source that knows none does not hide another's
                    for url in urls:
                        self._url_limits.setdefault(url, limits)

        all_urls = set().union(*wanted.values()) if wanted else set()
        added = [Replica(url) for url in sorted(all_urls - self.replicas.keys())]
        for replica in added:
            self.replicas[replica.url] = replica
        removed = [self.replicas.pop(url) for url in sorted(self.replicas.keys() - all_urls)]

        for model in self.pools.keys() - wanted.keys():
            del self.pools[model]
            log.info("pool %s removed", model)
        for model, urls in wanted.items():
            pool = self.pools.get(model)
            if pool is None:
                pool = self.pools[model] = Pool(
                    model, self._policy_factory(self._policies.get(model))
                )
                log.info("pool %s added (routing %s)", model, pool.policy.name)
            kept = [r for url, r in pool.replicas.items() if url in urls]
            new = [self.replicas[url] for url in sorted(urls - pool.replicas.keys())]
            if new or len(kept) != len(pool.replicas):
                pool.set_replicas(kept + new)
                log.info("pool %s: %d replicas %s", model, len(urls), sorted(urls))

        for url, replica in self.replicas.items():
            replica.pools = {model for model, urls in wanted.items() if url in urls}
        for replica in removed:
            replica.pools = set()
        if added or removed:
            for listener in self.listeners:
                listener(added, removed)
        self.notify()

    def limits_of(self, url: str) -> Limits:
        """The batch and queue bounds the replica at ``url`` was given by the LLMService that
        lists it, for a load read from ``/metrics``, which does not say them."""
        return self._url_limits.get(url, NO_LIMITS)

    def served_models(self) -> list[str]:
        return sorted(self.pools)
