"""The routing interface: a policy picks one replica of a pool for one request.

Policies are small classes (``round_robin``, ``least_load``, ``prefix_aware``) behind
:class:`RoutingPolicy`. The pool (``Pool.choose``) hands them only candidates that may take a
request (admitted, queue not full), never an empty list, and a :class:`LoadView` to read load
with.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from conveyor.gateway.prefix_key import RouteRequest
from conveyor.gateway.replica import Replica


@dataclass(frozen=True)
class LoadView:
    """Load as seen at one instant: ``now`` and how old a /load report may be."""

    now: float
    stale_after: float
    replica_queue: int | None = None
    """With ``--queue-at-gateway``: requests let wait on a replica beyond its batch; the pool
    offers only replicas with room for one more while any has it."""

    def outstanding(self, replica: Replica) -> float:
        return replica.outstanding(self.now, self.stale_after)

    def known(self, replica: Replica) -> bool:
        return replica.load_known(self.now, self.stale_after)

    def has_room(self, replica: Replica) -> bool:
        """Room for one more request (always, without ``replica_queue``)."""
        if self.replica_queue is None:
            return True
        return replica.has_room(self.now, self.stale_after, self.replica_queue)


@dataclass(frozen=True)
class Decision:
    replica: Replica
    reason: str
    """Why this replica: ``round_robin``, ``least_load``, or for prefix-aware ``affinity`` (the
    prefix's home), ``placement`` (a new prefix), ``overflow`` (its home was overloaded or out
    of reach) or ``rebalance`` (a replica that joined took over its ring arc); for any policy,
    ``response_affinity`` (the replica storing the response a request continues)."""


class RoutingPolicy(Protocol):
    name: str

    def choose(
        self, candidates: Sequence[Replica], request: RouteRequest, view: LoadView
    ) -> Decision: ...


def make_policy(name: str, *, bounded_load_factor: float, ring_vnodes: int) -> RoutingPolicy:
    """Build a fresh policy (each pool has its own counters and ring)."""
    from conveyor.gateway.least_load import LeastLoad
    from conveyor.gateway.prefix_aware import PrefixAware
    from conveyor.gateway.round_robin import RoundRobin

    if name == "round-robin":
        return RoundRobin()
    if name == "least-load":
        return LeastLoad()
    if name == "prefix-aware":
        return PrefixAware(bounded_load_factor=bounded_load_factor, vnodes=ring_vnodes)
    raise ValueError(
        f"unknown routing policy {name!r}; use one of prefix-aware, least-load, round-robin"
    )
