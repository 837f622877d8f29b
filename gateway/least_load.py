"""``least-load``: the candidate with the lowest score from queue depth, batch occupancy and KV usage."""

from __future__ import annotations

from collections.abc import Sequence

from conveyor.gateway.prefix_key import RouteRequest
from conveyor.gateway.replica import Replica
from conveyor.gateway.routing import Decision, LoadView

WAITING_WEIGHT = 1.0
"""Extra weight of a queued request over a running one: it waits for someone else to finish."""

KV_WEIGHT = 1.0
"""Weight of KV-cache usage (0..1): a full cache means preemptions, even with free batch slots."""


def load_score(replica: Replica, view: LoadView) -> float:
    """Lower is better. Outstanding requests against the batch size, plus queue and KV pressure.

    An idle replica scores 0; one with a full batch and nothing queued scores about 1 plus
    its KV usage. Without a fresh report only the gateway's own in-flight count is known.
    """
    outstanding = view.outstanding(replica)
    if replica.load is None or not view.known(replica):
        return outstanding
    capacity = replica.load.max_running_requests
    return (
        outstanding / capacity
        + WAITING_WEIGHT * replica.load.waiting / capacity
        + KV_WEIGHT * replica.load.kv_cache_usage
    )


def least_loaded(candidates: Sequence[Replica], view: LoadView, start: int = 0) -> Replica:
    """Replicas with fresh reports first (unknown is not idle), then by score.

    Ties go to the first candidate at or after ``start``, so equal replicas take turns.
    """
    n = len(candidates)
    best = candidates[start % n]
    best_key = (not view.known(best), load_score(best, view))
    for i in range(1, n):
        replica = candidates[(start + i) % n]
        key = (not view.known(replica), load_score(replica, view))
        if key < best_key:
            best, best_key = replica, key
    return best


class LeastLoad:
    name = "least-load"

    def __init__(self) -> None:
        self._turn = 0

    def choose(
        self, candidates: Sequence[Replica], request: RouteRequest, view: LoadView
    ) -> Decision:
        self._turn += 1
        return Decision(least_loaded(candidates, view, self._turn), "least_load")
