"""One runtime replica as the gateway sees it: its last /load record and its own in-flight count."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from conveyor.contracts.load import ReplicaLoad
from conveyor.contracts.response_id import replica_tag


@dataclass(eq=False)
class Replica:
    """Mutable routing state of one replica, owned by the event loop (no locks needed)."""

    url: str
    """Base URL without a trailing slash, e.g. ``http://10.0.0.7:8000``."""
    load: ReplicaLoad | None = None
    load_time: float = -math.inf
    """Monotonic time the last successful /load poll was sent."""
    heard_at: float = -math.inf
    """Monotonic send time of the request whose response last carried the replica's load."""
    progress_at: float = -math.inf
    """Monotonic send time of the last load report that showed the replica working: its engine
    took steps since the report before (any answered report, where it does not count steps)."""
    in_flight: int = 0
    """Requests this gateway has open on the replica right now."""
    in_flight_at_poll: int = 0
    """``in_flight`` when the last load report was taken (a poll's send, a response header's
    arrival): the part of it the replica already reported."""
    ejected_at: float = -math.inf
    ejected_until: float = -math.inf
    pools: set[str] = field(default_factory=set)
    """Models of the pools this replica belongs to."""
    tag: str = field(init=False)
    """What names it in the ids of the responses it stores (``contracts/response_id.py``)."""

    def __post_init__(self) -> None:
        self.tag = replica_tag(self.url)

    def admitted(self, now: float) -> bool:
        """Answered its last poll as ready and is not ejected."""
        return self.load is not None and self.load.ready and now >= self.ejected_until

    def load_known(self, now: float, stale_after: float) -> bool:
        return self.load is not None and now - self.load_time <= stale_after

    def outstanding(self, now: float, stale_after: float) -> float:
        """Requests queued or running on the replica, as best the gateway knows.

        The last report plus what this gateway sent since (a burst must not all land on the
        replica that looked idle); only the gateway's own count when the report is stale.
        """
        if self.load is None or not self.load_known(now, stale_after):
            return float(self.in_flight)
        return float(max(0, self.load.running + self.load.waiting + self.sent_since()))

    def sent_since(self) -> int:
        """Requests this gateway sent since the last report, less those that ended since."""
        return self.in_flight - self.in_flight_at_poll

    def queue_full(self, now: float, stale_after: float) -> bool:
        """By its last report, the replica would answer one more request 429: what would wait
        once its free batch slots are taken is over its queue bound (the replica's own rule,
        ``check_queue``: with ``--max-queued-requests 0`` an idle replica still takes one)."""
        load = self.load
        if load is None or load.max_queued_requests is None:
            return False
        if not self.load_known(now, stale_after):
            return False
        free_slots = max(0, load.max_running_requests - load.running)
        return load.waiting + 1 - free_slots > load.max_queued_requests

    def has_room(self, now: float, stale_after: float, queue: int) -> bool:
        """Room for one more request: fewer on the replica than its batch plus ``queue``
        waiting, as best the gateway knows, and its queue not at its own bound. Without a load
        report there is nothing to hold against: room.

        Its reported ``waiting`` alone is no sign of a full batch: a Conveyor replica writes
        the load header of a stream as it takes the request in, counting that request as
        waiting until its engine's next step."""
        if self.load is None:
            return True
        if self.queue_full(now, stale_after):
            return False
        return self.outstanding(now, stale_after) < self.load.max_running_requests + queue

    def eject(self, now: float, duration: float) -> bool:
        """Skip this replica for ``duration`` seconds; returns True if it was admitted before."""
        was_admitted = self.admitted(now)
        self.ejected_at = now
        self.ejected_until = now + duration
        return was_admitted

    def record_poll(self, report: ReplicaLoad, sent_at: float, in_flight_then: int) -> None:
        """A load report asked for at ``sent_at`` (a poll, or the request whose answer carried
        it) arrived, when this gateway had ``in_flight_then`` requests open on the replica; one
        asked for after the last ejection re-admits."""
        if sent_at < self.load_time:
            return  # an older poll finished after a newer one
        before = self.load
        if report.steps is None or before is None or before.steps != report.steps:
            self.progress_at = sent_at
        self.load = report
        self.load_time = sent_at
        self.in_flight_at_poll = in_flight_then
        if sent_at > self.ejected_at:
            self.ejected_until = -math.inf

    def record_poll_failure(self) -> None:
        """The replica did not answer /load: unknown and not routable until it answers again."""
        self.load = None
