"""``prefix-aware`` (the default): consistent hashing with bounded loads on the prompt's prefix.

The prompt's leading blocks hash to a point on a ring of replicas; the request goes to the
first replica clockwise whose load stays within ``bounded_load_factor`` times the mean
(Mirrokni et al., "Consistent Hashing with Bounded Loads"). Requests sharing a prefix meet
on the replica that has it cached; a hot prefix spills over to the next replicas on the
ring instead of piling onto one. Load is the outstanding-request estimate that least-load
also uses, so a replica's own queue and the gateway's recent sends both count. The ring is
built from the pool's members only, so every gateway replica makes the same choice from
the same loads without sharing state.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from conveyor.gateway.hash_ring import HashRing
from conveyor.gateway.least_load import least_loaded
from conveyor.gateway.prefix_key import RouteRequest
from conveyor.gateway.replica import Replica
from conveyor.gateway.routing import Decision, LoadView


def load_bound(total: float, members: int, factor: float) -> float:
    """Most requests one replica may hold once the new one is placed: ceil(c * (total + 1) / n)."""
    return math.ceil(factor * (total + 1) / members)


class PrefixAware:
    name = "prefix-aware"

    def __init__(self, bounded_load_factor: float = 1.25, vnodes: int = 100) -> None:
        if bounded_load_factor < 1.0:
            raise ValueError(
                f"bounded load factor must be at least 1.0 (got {bounded_load_factor}); 1.25 is usual"
            )
        self.factor = bounded_load_factor
        self.vnodes = vnodes
        self._ring = HashRing((), vnodes)
        self._ring_members: frozenset[str] = frozenset()
        self._turn = 0

    def set_members(self, urls: frozenset[str]) -> None:
        """The pool's replicas (ejected ones included, so an ejection moves no other keys)."""
        if urls != self._ring_members:
            self._ring = HashRing(urls, self.vnodes)
            self._ring_members = urls

    def choose(
        self, candidates: Sequence[Replica], request: RouteRequest, view: LoadView
    ) -> Decision:
        by_url = {replica.url: replica for replica in candidates}
        if not by_url.keys() <= self._ring_members:
            self.set_members(self._ring_members | by_url.keys())
        loads = {url: view.outstanding(replica) for url, replica in by_url.items()}
        bound = load_bound(sum(loads.values()), len(loads), self.factor)
        first = True
        for url in self._ring.walk(request.key):
            if url not in by_url:
                continue  # ejected or queue full: not a candidate now
            if loads[url] + 1 <= bound:
                return Decision(by_url[url], "affinity" if first else "overflow")
            first = False
        self._turn += 1  # unreachable with whole-request loads; kept for fractional ones
        return Decision(least_loaded(candidates, view, self._turn), "least_load")
