"""What the autoscaler's decision reads, returns and remembers.

``AutoscalingPolicy`` is the LLMService's ``spec.autoscaling``; an ``Observation`` (with its
``Demand`` and ``ReplicaSignals``) is what the timer saw at one tick; a ``Decision`` (with its
``Estimate``) is what ``autoscaler.decide`` returns; a ``History`` is what it keeps between
calls, one per LLMService. Plain data: no Kubernetes, no clock, no I/O.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class AutoscalingPolicy:
    """The LLMService's ``spec.autoscaling``, in seconds and replicas."""

    enabled: bool = False
    min_replicas: int = 1
    max_replicas: int = 4
    target_queue_depth: float = 4.0
    """Waiting requests per ready replica."""
    target_ttft_p95: float | None = None
    """Seconds; None ignores TTFT."""
    target_kv_cache_usage: float = 0.9
    scale_up_stabilization: float = 0.0
    scale_down_stabilization: float = 300.0
    scale_to_zero_idle: float = 600.0
    max_scale_up_step: int = 8
    """Most replicas added in one decision."""
    max_scale_down_step: int = 2
    """Most replicas removed in one decision."""
    target_utilization: float = 1.0
    """Demand / (replicas x capacity) to size for. Capacity is what a replica does while
    saturated, so 1.0 sizes to exactly that (the queue and TTFT targets guard latency);
    below 1 keeps headroom for bursts."""
    backlog_drain: float = 30.0
    """Seconds in which the backlog (queued and held requests) should drain on top of demand."""
    demand_window: float = 60.0
    """Seconds of arrivals the demand is averaged over (KPA's stable window): long enough that
    Poisson noise and queue swings at 90% load do not read as a change; the panic window sees
    a step within seconds."""
    panic_window: float = 6.0
    """Seconds of the short window that sees a burst (KPA's panic window)."""
    capacity_requests_per_second: float | None = None
    """Starting guess of one replica's requests/s; None: none until measured."""
    capacity_tokens_per_second: float | None = None
    """Starting guess of one replica's prompt + generated tokens/s; None: none until measured."""

    @classmethod
    def from_spec(cls, spec: dict[str, Any] | None) -> AutoscalingPolicy:
        s = spec or {}
        d = cls()
        ttft = s.get("targetTTFTP95Seconds")
        cap_rps = s.get("capacityRequestsPerSecond")
        cap_tps = s.get("capacityTokensPerSecond")
        return cls(
            enabled=bool(s.get("enabled", d.enabled)),
            min_replicas=int(s.get("minReplicas", d.min_replicas)),
            max_replicas=int(s.get("maxReplicas", d.max_replicas)),
            target_queue_depth=float(s.get("targetQueueDepthPerReplica", d.target_queue_depth)),
            target_ttft_p95=None if ttft is None else float(ttft),
            target_kv_cache_usage=float(s.get("targetKVCacheUsage", d.target_kv_cache_usage)),
            scale_up_stabilization=float(
                s.get("scaleUpStabilizationSeconds", d.scale_up_stabilization)
            ),
            scale_down_stabilization=float(
                s.get("scaleDownStabilizationSeconds", d.scale_down_stabilization)
            ),
            scale_to_zero_idle=float(s.get("scaleToZeroIdleSeconds", d.scale_to_zero_idle)),
            max_scale_up_step=int(s.get("maxScaleUpStep", d.max_scale_up_step)),
            max_scale_down_step=int(s.get("maxScaleDownStep", d.max_scale_down_step)),
            target_utilization=float(s.get("targetUtilization", d.target_utilization)),
            backlog_drain=float(s.get("backlogDrainSeconds", d.backlog_drain)),
            demand_window=float(s.get("demandWindowSeconds", d.demand_window)),
            panic_window=float(s.get("panicWindowSeconds", d.panic_window)),
            capacity_requests_per_second=None if cap_rps is None else float(cap_rps),
            capacity_tokens_per_second=None if cap_tps is None else float(cap_tps),
        )

    @property
    def capacity_guess(self) -> Rates | None:
        if self.capacity_requests_per_second is None:
            return None
        return Rates(self.capacity_requests_per_second, self.capacity_tokens_per_second or 0.0)


@dataclass(frozen=True)
class Rates:
    """Requests and tokens (prompt + generated) per second."""

    requests: float
    tokens: float = 0.0


@dataclass(frozen=True)
class Demand:
    """Rates the timer measured from the replicas' counters and the backlog over two windows.

    Arrivals are what finished plus how much the backlog (running, waiting and held at the
    gateways) grew: the requests that came, whether or not they were served yet.
    """

    arrivals: Rates
    """Over the demand window."""
    arrivals_panic: Rates
    """Over the panic window."""
    backlog_growth: float
    """Requests/s the backlog grew over the panic window (negative: it shrank)."""
    saturated: Rates | None = None
    """Mean throughput of the replicas that had a queue through the whole panic window: a
    measurement of capacity. None when no replica did."""
    busy: Rates | None = None
    """Mean throughput of the replicas that have a queue now, since their queue began (within
    the panic window): capacity from a shorter span, for when nothing was measured yet. None
    when no replica had a queue at its last two scrapes."""
    arrivals_recent: Rates | None = None
    """Over the last half of the panic window: a step shows here whole while the panic window
    still averages it with the load before. None without scrapes to measure it."""
    recent_growth: float = 0.0
    """Requests/s the backlog grew over that last half."""


@dataclass(frozen=True)
class ReplicaSignals:
    """One ready replica's ``/load`` at the time of the observation."""

    waiting: int
    running: int
    max_running: int
    kv_cache_usage: float


@dataclass(frozen=True)
class Observation:
    """What the timer saw at ``time`` (seconds on any monotonic clock)."""

    time: float
    current_replicas: int
    """``spec.replicas`` now (may be outside [min, max] after a manual scale)."""
    ready: tuple[ReplicaSignals, ...]
    """Replicas that are ready and answered; loading or unreachable ones are left out."""
    ttft_p95: float | None = None
    """Service-wide TTFT p95 over the last window (from histogram deltas); None: no data."""
    pending_requests: int = 0
    """Requests held by the gateways because no replica is ready (scale from zero)."""
    unseen_requests: int = 0
    """Requests the gateways sent to ready replicas beyond what those count as running and
    waiting: not taken in yet (a replica's HTTP server still reading or tokenizing them)."""
    demand: Demand | None = None
    """Arrival and throughput rates; None until the timer has a window of counters."""
    counting: bool = False
    """Every ready replica exposes the counters demand comes from: a missing ``demand`` is a
    window still to come (the first tick after a start), not an engine without them."""

    @property
    def num_ready(self) -> int:
        return len(self.ready)

    @property
    def waiting(self) -> int:
        return sum(r.waiting for r in self.ready)

    @property
    def queued(self) -> int:
        """Requests queued on ready replicas or held at the gateways: the queue depth. A gateway
        that queues (``--queue-at-gateway``) holds what would otherwise wait on the replicas;
        one that does not holds only while it sees no replica ready, which a tick may catch
        for a moment after the first one turned ready (its requests then go at once)."""
        return self.waiting + self.pending_requests

    @property
    def running(self) -> int:
        return sum(r.running for r in self.ready)

    @property
    def backlog(self) -> int:
        """Requests queued on ready replicas, on their way in, or held at the gateways."""
        return self.queued + self.unseen_requests

    @property
    def busy(self) -> bool:
        return self.running > 0 or self.backlog > 0


@dataclass(frozen=True)
class Estimate:
    """Why a capacity-sized decision came out as it did (status and metrics show it)."""

    demand: Rates
    """Arrivals over the demand window."""
    capacity: Rates
    """One replica's, as used for this decision."""
    capacity_source: str
    """"measured", "guess" (the spec's) or "lower-bound" (the highest throughput a busy
    replica showed)."""
    utilization: float
    """Demand / (ready replicas x capacity), by the tighter of requests and tokens."""
    replicas_needed: float
    """Demand and backlog drain over capacity x target utilization, before rounding."""
    panic: bool
    start_time: float | None = None
    """Seconds a replica takes to be ready, as learned; None until one was seen starting."""
    burst: Rates | None = None
    """Arrivals over the panic window, or its last half (``burst_arrivals``): what a panic
    reads."""
    burst_replicas_needed: float | None = None
    """What those arrivals and the backlog's drain call for; a panic is above 1.5x the ready
    replicas."""


@dataclass(frozen=True)
class Decision:
    desired: int
    direction: str  # "up", "down" or "none"
    reason: str
    recommendation: int
    """What the load alone calls for now (before bounds, windows and step limits)."""
    estimate: Estimate | None = None
    """Demand, capacity and utilization; None when the decision was the signals' own."""
    held_by: str | None = None
    """With no change: why not fewer replicas. What called for the most over the scale-down
    window (``demand``, a signal's name, ``running``, ``breach-floor``, ``busy``), or what
    keeps any scale-down off (``panic``, ``settling``, ``starting``); None when nothing does
    (the window is not over yet, or the count is at the minimum)."""


@dataclass
class History:
    """What ``decide`` remembers between calls (one per LLMService, kept by the timer)."""

    recommendations: deque[tuple[float, int, tuple[int, str]]] = field(default_factory=deque)
    """(time, recommended replicas for scale-up, (for scale-down with the margin, what called
    for that many))."""
    last_busy: float | None = None
    """Last time any request was running, waiting or pending, or no replica was ready."""
    first_seen: float | None = None
    capacity: Rates | None = None
    """One replica's measured capacity (seeded from status after an operator restart)."""
    capacity_time: float | None = None
    """When ``capacity`` was last measured."""
    capacity_steady: bool = False
    """``capacity`` holds a measurement taken without overload (``update_capacity``)."""
    last_overload: float | None = None
    """When a measurement was last taken under overload."""
    capacity_floor: Rates | None = None
    """The highest throughput a busy replica was seen to have: a lower bound of capacity, for
    until one is measured (lower bounds of one figure combine by their maximum)."""
    last_panic: float | None = None
    """Last time the panic window called for more than ready and starting replicas carry."""
    breaches: deque[tuple[float, float, str, int]] = field(default_factory=deque)
    """(time, ratio, signal, backlog) at each tick of the last half demand window with every
    replica ready: the highest of queue depth per replica, TTFT p95 and KV usage over its
    target, and the requests queued or held."""
    queued: deque[tuple[float, bool]] = field(default_factory=deque)
    """(time, every ready replica had a queue) at each tick of the last demand window."""
    queue_depths: deque[tuple[float, int]] = field(default_factory=deque)
    """(time, requests queued or held) at each tick of the last panic window."""
    breach_count: tuple[int, float] | None = None
    """(replicas, since): the count ``breaches`` were taken at, and its first tick with
    every replica ready; a new count starts them afresh."""
    last_up: float | None = None
    """Last time a decision added replicas."""
    starts: list[tuple[float, int]] = field(default_factory=list)
    """(since, replicas): counts asked for (or seen short of ready) and not all ready yet."""
    start_time: float | None = None
    """Seconds from asking for replicas to their being ready, as seen (averaged)."""
    guard_floor: tuple[int, float] | None = None
    """(replicas, demand in requests/s) when a lasting breach last added a replica: no
    scale-down below it while demand stays within 10% of that and the service is not idle
    (else it would flap)."""

    def record(self, time: float, up: int, down: tuple[int, str], keep: float) -> None:
        self.recommendations.append((time, up, down))
        while self.recommendations and self.recommendations[0][0] < time - keep:
            self.recommendations.popleft()
