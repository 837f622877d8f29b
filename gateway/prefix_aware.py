"""``prefix-aware`` (the default): a prompt prefix keeps its replica; new prefixes are placed
by consistent hashing with bounded loads.

A prompt's leading blocks make its key (for a chat, the conversation's opening, which every
turn repeats). The policy remembers where each key last went, its *home*, in a bounded
table (least recently used first out), and:

- a key with a home goes there while the home's load stays within ``bounded_load_factor``
  times the mean, or the home has a free slot in its running batch and an empty queue
  (``affinity``): every turn of a conversation meets its cached prefix;
- a new key, or one whose home is over that bound or gone, is *placed*: its hash picks a
  point on a ring of replicas and it goes to the first replica clockwise whose load is at
  most the mean (``placement`` for a new key, ``overflow`` for a moved one), and that
  replica becomes its home. A home that is only out of reach for now (ejected, queue full,
  not yet admitted) stays the key's home: the request is placed elsewhere, the next one
  goes back.

Placing at the mean, not at ``bounded_load_factor`` times it, is what keeps the replicas
even: with a few dozen conversations, hashing alone puts half again as many on one replica
as on another (balls into bins), and a loose bound lets a burst of new conversations pile
up there; at the mean a burst spreads exactly, and the looser bound for known keys then
only moves a conversation when its replica is really overloaded. This is the split the
SGLang router's cache_aware policy makes (a prefix it has seen goes where its tree matches;
one it has not, to the worker with the least cached), with a hash ring instead of a radix
tree per replica, so new keys still prefer the same replica in every gateway.

A replica that joins takes over the keys whose ring point now falls on it, as in plain
consistent hashing: about 1/n of the conversations move, once the new replica is admitted
(each misses its prefix once, ``rebalance``), and the new replica carries its share at
once, where keeping every home would leave it idle while the others, whose caches are full
if capacity was added, keep evicting. Every other key keeps its home and its cache.

Load is the outstanding-request estimate that least-load also uses (Mirrokni et al.,
"Consistent Hashing with Bounded Loads"), so a replica's own queue and the gateway's recent
sends both count. Two gateway processes agree on a new key's ring walk; a key one of them
placed away from the ring's first replica (loads differed) may be placed differently by the
other, which costs that conversation one prefix miss, never balance.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence

from conveyor.gateway.hash_ring import HashRing
from conveyor.gateway.least_load import least_loaded
from conveyor.gateway.prefix_key import RouteRequest
from conveyor.gateway.replica import Replica
from conveyor.gateway.routing import Decision, LoadView

MAX_HOMES = 100_000
"""Keys whose home is remembered (about 10 MB); far more conversations than a pool's caches
hold, so a key forgotten here has long left every replica's cache too."""


def load_bound(total: float, members: int, factor: float) -> float:
    """Most requests one replica may hold once the new one is placed: ceil(c * (total + 1) / n)."""
    return math.ceil(factor * (total + 1) / members)


def has_free_slot(replica: Replica, load: float, view: LoadView) -> bool:
    """The replica said it queues nothing and has room in its running batch for one more:
    it starts the request at once, so moving it would trade a prefix miss for nothing (at
    low load the bound is a request or two, and a report 200 ms old trips it)."""
    report = replica.load
    return (
        report is not None
        and view.known(replica)
        and report.waiting == 0
        and load + 1 <= report.max_running_requests
    )


class PrefixAware:
    name = "prefix-aware"

    def __init__(
        self, bounded_load_factor: float = 1.25, vnodes: int = 100, max_homes: int = MAX_HOMES
    ) -> None:
        if bounded_load_factor < 1.0:
            raise ValueError(
                f"bounded load factor must be at least 1.0 (got {bounded_load_factor}); 1.25 is usual"
            )
        self.factor = bounded_load_factor
        self.vnodes = vnodes
        self.max_homes = max_homes
        self._ring = HashRing((), vnodes)
        self._ring_members: frozenset[str] = frozenset()
        self._homes: OrderedDict[int, tuple[str, int]] = OrderedDict()
        """Routing key -> (the replica its prefix was last sent to, the membership generation
        then), least recently used first."""
        self._generation = 0
        """Counts membership changes that added a replica."""
        self._joined_at: dict[str, int] = {}
        """Member -> the generation it joined in."""
        self._turn = 0

    def set_members(self, urls: frozenset[str]) -> None:
        """The pool's replicas (ejected ones included, so an ejection moves no other keys).

        A key whose home left is placed again on its next request; one whose ring point
        falls on a replica that joined after the key was homed moves to it (``choose``).
        """
        if urls == self._ring_members:
            return
        self._generation += 1
        for url in urls - self._ring_members:
            self._joined_at[url] = self._generation
        for url in self._ring_members - urls:
            del self._joined_at[url]
        self._ring = HashRing(urls, self.vnodes)
        self._ring_members = urls

    def choose(
        self, candidates: Sequence[Replica], request: RouteRequest, view: LoadView
    ) -> Decision:
        by_url = {replica.url: replica for replica in candidates}
        if not by_url.keys() <= self._ring_members:
            self.set_members(self._ring_members | by_url.keys())
        loads = {url: view.outstanding(replica) for url, replica in by_url.items()}
        key = request.key
        home, since = self._homes.get(key, (None, 0))
        reason = "affinity"
        if home is not None:
            owner = self._ring.first(key)
            if owner in by_url and owner != home and self._joined_at.get(owner, 0) > since:
                home, reason = owner, "rebalance"  # joined after the key was homed: its arc
        bound = load_bound(sum(loads.values()), len(loads), self.factor)
        if home in by_url and (
            loads[home] + 1 <= bound or has_free_slot(by_url[home], loads[home], view)
        ):
            # the generation moves on only with the home: a key that stayed on its old
            # home while a joined replica was not yet admitted still moves to it later
            self._remember(key, home, since if reason == "affinity" else self._generation)
            return Decision(by_url[home], reason)
        if home in self._ring_members and home not in by_url:
            return self._place(key, by_url, loads, view, "overflow")  # home back later
        decision = self._place(
            key, by_url, loads, view, "placement" if home is None else "overflow"
        )
        self._remember(key, decision.replica.url, self._generation)
        return decision

    def _remember(self, key: int, home: str, since: int) -> None:
        self._homes[key] = (home, since)
        self._homes.move_to_end(key)
        if len(self._homes) > self.max_homes:
            self._homes.popitem(last=False)

    def _place(
        self,
        key: int,
        by_url: dict[str, Replica],
        loads: dict[str, float],
        view: LoadView,
        reason: str,
    ) -> Decision:
        """The first replica on the ring from ``key`` whose load stays at most the mean."""
        bound = load_bound(sum(loads.values()), len(loads), 1.0)
        for url in self._ring.walk(key):
            if url in by_url and loads[url] + 1 <= bound:  # not a candidate: ejected or full
                return Decision(by_url[url], reason)
        self._turn += 1  # unreachable with whole-request loads; kept for fractional ones
        return Decision(least_loaded(list(by_url.values()), view, self._turn), "least_load")
