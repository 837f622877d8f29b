"""``round-robin``: each candidate in turn; the baseline the other policies are measured against."""

from __future__ import annotations

from collections.abc import Sequence

from conveyor.gateway.prefix_key import RouteRequest
from conveyor.gateway.replica import Replica
from conveyor.gateway.routing import Decision, LoadView


class RoundRobin:
    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(
        self, candidates: Sequence[Replica], request: RouteRequest, view: LoadView
    ) -> Decision:
        replica = candidates[self._next % len(candidates)]
        self._next += 1
        return Decision(replica, "round_robin")
