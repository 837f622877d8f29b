"""The autoscaler's decision: a pure function of signals, policy and history.

    decide(observation, policy, history) -> Decision(desired, direction, reason, ...)

Replicas are sized from capacity, as AIBrix's and Knative's KPA and Dynamo's planner do:

    desired = ceil(demand / (capacity x targetUtilization) + backlog / (capacity x drain time))

where demand is the arrival rate of requests (and of tokens) over the demand window,
capacity is one replica's throughput while saturated (measured, remembered in the history
and in status; a starting guess from the spec until then), and the backlog is what waits
on the replicas and at the gateways, plus what will pile up on the ready replicas until
the replicas asked for are ready (their start time is learned). ``spec.replicas`` counts
replicas that are still starting, so they are capacity to come: the backlog that piles up
on the ready ones while they start is not read again as demand for more. Within 10% of the
current count is no change (the HPA's tolerance), and the count is rounded up only past
10% of a replica, on the way up and down alike. Both the demand window and the panic window
must call for more, and something must be running, waiting or held, for a scale-up; the
lower of the two sizes a scale-down (the panic window forgets a load that is gone, the
demand window damps the panic window's noise), and an idle service calls for none.

A short panic window (KPA's) reacts to a burst: when the backlog grows and the demand of
the last seconds exceeds what ready and starting replicas will carry, the count that demand
calls for is taken at once (still demand over capacity, never queue length over a target),
and nothing scales down until the panic has been over for a demand window.

The queue-depth, TTFT and KV-cache targets stay as triggers and guards. Arrivals measured on
a saturated fleet are bounded by its throughput (a closed loop of clients sends exactly as
fast as it is answered), so demand over capacity cannot ask for more there: when every replica
had a queue at nearly every tick of the demand window and a signal has stayed above its target
for half a demand window (by the median of its ticks, so that one tick at the line does not
start the wait again; not while the backlog drains), with every replica ready and the estimate
content, the demand reads as one replica more than the count, which is added (and kept while
demand holds); no scale-down while a signal is above its target with a margin, nor, for a
busy service, within a demand window of a scale-up (the window still holds the old count's
arrivals, and a closed loop sends more once served faster).

Without a capacity figure (nothing measured, no guess, no busy replica to take a lower bound
from) the decision is the signals' own, as the HPA computes it (``ceil(ready * signal /
target)``). Down is patient: only to the largest
count any moment of the stabilization window called for. Replicas still loading count
neither as capacity nor as idle, and never freeze a decision.

No Kubernetes, no clock, no I/O: the kopf timer gathers an ``Observation``,
calls ``decide``, and writes the result.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

SCALE_DOWN_MARGIN = 0.8
"""Signals must be below target x this for a scale-down (hysteresis against flapping)."""
TOLERANCE = 0.1
"""Ignore a computed change of less than 10% of the ready replicas (the HPA's default)."""
SATURATED = 0.9
"""Share of the demand window's ticks at which every ready replica must have had a queue for
the fleet to read as saturated (a tick between two of a client's requests may find one
without)."""
DRAINING = 0.8
"""A backlog whose median over the later half of a breach's window is below this share of the
earlier half's is draining: no replica is added for that breach."""
PANIC_THRESHOLD = 1.5
"""Panic when the panic window calls for this many times the ready and starting replicas.
KPA's default is 2.0; a replica is a large unit here, and one to two is a burst to answer at
once, while a 6 s window's noise at steady load stays well below 1.5."""


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
    def running(self) -> int:
        return sum(r.running for r in self.ready)

    @property
    def backlog(self) -> int:
        """Requests queued on ready replicas or held at the gateways."""
        return self.waiting + self.pending_requests

    @property
    def busy(self) -> bool:
        return self.waiting > 0 or self.running > 0 or self.pending_requests > 0


@dataclass(frozen=True)
class Estimate:
    """Why a capacity-sized decision came out as it did (status and metrics show it)."""

    demand: Rates
    """Arrivals over the demand window."""
    capacity: Rates
    """One replica's, as used for this decision."""
    capacity_source: str
    """"measured", "guess" (the spec's) or "lower-bound" (busy replicas' throughput now)."""
    utilization: float
    """Demand / (ready replicas x capacity), by the tighter of requests and tokens."""
    replicas_needed: float
    """Demand and backlog drain over capacity x target utilization, before rounding."""
    panic: bool
    start_time: float | None = None
    """Seconds a replica takes to be ready, as learned; None until one was seen starting."""


@dataclass(frozen=True)
class Decision:
    desired: int
    direction: str  # "up", "down" or "none"
    reason: str
    recommendation: int
    """What the load alone calls for now (before bounds, windows and step limits)."""
    estimate: Estimate | None = None
    """Demand, capacity and utilization; None when the decision was the signals' own."""


@dataclass
class History:
    """What ``decide`` remembers between calls (one per LLMService, kept by the timer)."""

    recommendations: deque[tuple[float, int, int]] = field(default_factory=deque)
    """(time, recommended replicas for scale-up, for scale-down with the margin)."""
    last_busy: float | None = None
    """Last time any request was running, waiting or pending, or no replica was ready."""
    first_seen: float | None = None
    capacity: Rates | None = None
    """One replica's measured capacity (seeded from status after an operator restart)."""
    capacity_time: float | None = None
    """When ``capacity`` was last measured."""
    last_panic: float | None = None
    """Last time the panic window called for more than ready and starting replicas carry."""
    breaches: deque[tuple[float, float, str, int]] = field(default_factory=deque)
    """(time, ratio, signal, backlog) at each tick of the last half demand window with every
    replica ready: the highest of queue depth per replica, TTFT p95 and KV usage over its
    target, and the requests queued or held."""
    queued: deque[tuple[float, bool]] = field(default_factory=deque)
    """(time, every ready replica had a queue) at each tick of the last demand window."""
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

    def record(self, time: float, up: int, down: int, keep: float) -> None:
        self.recommendations.append((time, up, down))
        while self.recommendations and self.recommendations[0][0] < time - keep:
            self.recommendations.popleft()


def guards(obs: Observation, policy: AutoscalingPolicy, margin: float = 1.0) -> tuple[int, str]:
    """Replicas that keep queue depth, TTFT p95 and KV usage at ``target x margin``, and the
    signal that calls for the most (as the HPA computes it: ``ceil(ready * signal / target)``).
    """
    ready = obs.num_ready
    candidates = [(0, "idle")]
    q_target = policy.target_queue_depth * margin
    candidates.append((math.ceil(obs.waiting / q_target), "queue-depth"))
    if policy.target_ttft_p95 is not None and obs.ttft_p95 is not None:
        ratio = obs.ttft_p95 / (policy.target_ttft_p95 * margin)
        candidates.append((math.ceil(ready * ratio), "ttft-p95"))
    kv = sum(r.kv_cache_usage for r in obs.ready) / ready
    candidates.append((math.ceil(ready * kv / (policy.target_kv_cache_usage * margin)), "kv-cache"))
    return max(candidates)


def recommend(obs: Observation, policy: AutoscalingPolicy, margin: float = 1.0) -> tuple[int, str]:
    """Replicas the signals alone call for (no capacity figure), and the signal that calls for
    the most.

    ``margin`` < 1 lowers every target: the count at which all signals sit
    below ``target x margin``, which is what a scale-down must satisfy.
    """
    if obs.num_ready == 0:
        return (1 if obs.pending_requests else 0), "pending-requests"
    candidates = [guards(obs, policy, margin)]
    # Requests in flight need slots: keep enough replicas for them.
    slots = max(1, min(r.max_running for r in obs.ready))
    candidates.append((math.ceil(obs.running / (slots * margin)), "running"))
    if obs.pending_requests:
        candidates.append((1, "pending-requests"))
    return max(candidates)


def update_capacity(obs: Observation, policy: AutoscalingPolicy, history: History) -> None:
    """Fold a capacity measurement into the history: the first replaces the spec's guess, later
    ones are averaged with a time constant of the demand window (one tick's noise is damped,
    a new model or image is followed within a minute or two)."""
    sample = obs.demand.saturated if obs.demand is not None else None
    if sample is None or sample.requests <= 0:
        return
    old, then = history.capacity, history.capacity_time
    if old is None or then is None:
        history.capacity = sample
    else:
        a = 1.0 - math.exp(-max(0.0, obs.time - then) / policy.demand_window)
        history.capacity = Rates(
            old.requests + a * (sample.requests - old.requests),
            old.tokens + a * (sample.tokens - old.tokens),
        )
    history.capacity_time = obs.time


def capacity_for(
    obs: Observation, policy: AutoscalingPolicy, history: History
) -> tuple[Rates, str] | None:
    """The capacity of one replica to size with, and where it came from; None: no figure."""
    if history.capacity is not None and history.capacity.requests > 0:
        return history.capacity, "measured" if history.capacity_time is not None else "status"
    guess = policy.capacity_guess
    if guess is not None and guess.requests > 0:
        return guess, "guess"
    busy = obs.demand.busy if obs.demand is not None else None
    if busy is not None and busy.requests > 0:
        return busy, "lower-bound"
    return None


def replicas_needed(rates: Rates, capacity: Rates, utilization: float) -> float:
    """Replicas that carry ``rates`` at ``utilization``, by the tighter of requests and tokens."""
    need = rates.requests / (capacity.requests * utilization)
    if capacity.tokens > 0:
        need = max(need, rates.tokens / (capacity.tokens * utilization))
    return need


def guard_ratio(obs: Observation, policy: AutoscalingPolicy) -> tuple[float, str]:
    """The signal furthest above (or least below) its target, as signal / target."""
    n = obs.num_ready
    ratios = [(obs.waiting / n / policy.target_queue_depth, "queue-depth")]
    if policy.target_ttft_p95 is not None and obs.ttft_p95 is not None:
        ratios.append((obs.ttft_p95 / policy.target_ttft_p95, "ttft-p95"))
    kv = sum(r.kv_cache_usage for r in obs.ready) / n
    ratios.append((kv / policy.target_kv_cache_usage, "kv-cache"))
    return max(ratios)


def lasting_breach(obs: Observation, policy: AutoscalingPolicy, history: History) -> str | None:
    """The signal that has stayed above its target for half a demand window at this replica
    count, with every replica ready; None if none has.

    "Stayed" is by the median of the window's ticks and of its later half: one tick under
    target (a queue at the line, a client between two requests) does not start the window
    again, nor does one tick far above it make a breach; nor is a backlog that drains (its
    median over the later half a fifth below the earlier half's) a lasting breach. Ticks with a replica not ready (starting, or its
    scrape missed) are left out; a change of count starts afresh.
    """
    now, current = obs.time, obs.current_replicas
    if history.breach_count is not None and history.breach_count[0] != current:
        history.breaches.clear()
        history.breach_count = None
    if obs.num_ready < current or obs.num_ready == 0:
        return None
    if history.breach_count is None:
        history.breach_count = (current, now)
    window = policy.demand_window / 2
    history.breaches.append((now, *guard_ratio(obs, policy), obs.backlog))
    while history.breaches[0][0] < now - window:
        history.breaches.popleft()
    ticks = list(history.breaches)
    earlier = [b for b in ticks if b[0] < now - window / 2]
    later = [b for b in ticks if b[0] >= now - window / 2]
    if now - history.breach_count[1] < window or len(earlier) < 2 or len(later) < 2:
        return None
    if statistics.median(b[1] for b in ticks) <= 1 or statistics.median(b[1] for b in later) <= 1:
        return None
    if statistics.median(b[3] for b in later) < DRAINING * statistics.median(b[3] for b in earlier):
        return None  # the backlog drains: replicas that came are catching up
    above = [b[2] for b in later if b[1] > 1]
    return max(set(above), key=above.count)


def track_queues(obs: Observation, policy: AutoscalingPolicy, history: History) -> None:
    """Record whether every ready replica has a queue now (ticks without one say nothing)."""
    if obs.num_ready == 0:
        return
    history.queued.append((obs.time, all(r.waiting > 0 for r in obs.ready)))
    while history.queued[0][0] < obs.time - policy.demand_window:
        history.queued.popleft()


def saturated(obs: Observation, policy: AutoscalingPolicy, history: History) -> bool:
    """Whether the fleet has been saturated for the whole demand window: every ready replica
    had a queue at nearly every tick. It then finished all it could, so the arrivals its
    counters show may be its throughput, short of the demand (a closed loop of clients sends
    exactly as fast as it is answered), whatever capacity figure it is compared with."""
    first = history.first_seen
    if first is None or obs.time - first < policy.demand_window or not history.queued:
        return False
    return sum(q for _, q in history.queued) >= SATURATED * len(history.queued)


def track_starts(obs: Observation, history: History) -> None:
    """Learn how long replicas take to be ready: a count asked for (or seen short of ready)
    is a start; the tick at which as many are ready ends it."""
    now, current, ready = obs.time, obs.current_replicas, obs.num_ready
    for since, n in list(history.starts):
        if ready >= n:
            sample = now - since
            old = history.start_time
            history.start_time = sample if old is None else (old + sample) / 2
            history.starts.remove((since, n))
        elif n > current:  # asked for more than is now wanted: never to be reached
            history.starts.remove((since, n))
    if ready < current and not any(n >= current for _, n in history.starts):
        history.starts.append((now, current))


def time_to_capacity(obs: Observation, history: History) -> float:
    """Seconds until replicas asked for now (or starting since) are ready, as far as the
    learned start time tells; 0 while none was learned."""
    if history.start_time is None:
        return 0.0
    oldest = min((since for since, _ in history.starts), default=obs.time)
    return max(0.0, history.start_time - (obs.time - oldest))


def sized(
    obs: Observation, policy: AutoscalingPolicy, history: History, capacity: tuple[Rates, str]
) -> tuple[int, str, int, Estimate]:
    """Capacity-sized recommendation: (up, reason, down, estimate); see the module docstring."""
    assert obs.demand is not None and obs.num_ready > 0
    cap, source = capacity
    current, u = obs.current_replicas, policy.target_utilization
    # The backlog to drain: what waits now, and what will pile up on the ready replicas until
    # capacity asked for now (or starting) comes.
    coming = time_to_capacity(obs, history)
    ready_rate = obs.num_ready * cap.requests

    def with_drain(arrivals: Rates) -> float:
        expected = obs.backlog + max(0.0, arrivals.requests - ready_rate) * coming
        drain = expected / (policy.backlog_drain * cap.requests * u)
        return replicas_needed(arrivals, cap, u) + drain

    need = with_drain(obs.demand.arrivals)
    need_panic = with_drain(obs.demand.arrivals_panic)
    # Panic: the backlog grows and the last seconds call for more than ready and starting
    # replicas will carry. While a panic is recent, the short window sizes scale-ups too (it
    # sees a step at once, the demand window only as it fills).
    if obs.demand.backlog_growth > 0 and need_panic > current * PANIC_THRESHOLD:
        history.last_panic = obs.time
    panic = history.last_panic is not None and obs.time - history.last_panic < policy.demand_window
    # Both windows must call for more (the demand window damps the panic window's noise; the
    # panic window forgets a load that is gone, which the demand window remembers for a
    # minute), and something must be running, waiting or held.
    level = min(need, need_panic)
    up, reason = current, "demand"
    if obs.busy and level > current * (1 + TOLERANCE):
        up = math.ceil(level / (1 + TOLERANCE))
    up_panic = math.ceil(need_panic / (1 + TOLERANCE))
    if panic and need_panic > current * (1 + TOLERANCE) and up_panic > up:
        up, reason = up_panic, "panic"
    breach = lasting_breach(obs, policy, history)
    demand = obs.demand.arrivals.requests
    if up <= current and breach is not None and saturated(obs, policy, history):
        # The estimate is content, yet a signal stays above its target with every replica
        # ready, on a fleet that had a queue throughout the demand window. Arrivals measured
        # on a saturated fleet are its throughput (a closed loop of clients sends exactly as
        # fast as it is answered), so the demand is at least what the replicas carry, plus a
        # step: one more replica, kept while demand stays where it was.
        up, reason = current + 1, breach
        need = max(need, current + 1.0)
        history.guard_floor = (current + 1, demand)
        history.breaches.clear()  # one replica per half window, should this one not come
        history.breach_count = (current, obs.time)
    guard_down, _ = guards(obs, policy, margin=SCALE_DOWN_MARGIN)
    # Down follows the lower of the two windows (a drop shows in the panic window within
    # seconds, while the demand window remembers the load for a minute), and idle (nothing
    # running, waiting or held) calls for none; the stabilization window is what keeps these
    # from flapping.
    down = 0
    if obs.busy:
        down = max(math.ceil(level / (1 + TOLERANCE)), guard_down, 1)
    if history.guard_floor is not None:
        floor, at = history.guard_floor
        if demand < at * (1 - TOLERANCE):
            history.guard_floor = None  # demand fell: the estimate decides again
        else:
            down = max(down, floor)
    use = replicas_needed(obs.demand.arrivals, cap, 1.0) / obs.num_ready
    estimate = Estimate(
        obs.demand.arrivals, cap, source, use, need, panic, start_time=history.start_time
    )
    return up, reason, down, estimate


def decide(obs: Observation, policy: AutoscalingPolicy, history: History) -> Decision:
    now, current = obs.time, obs.current_replicas
    if history.first_seen is None:
        history.first_seen = now
    if obs.busy or obs.num_ready == 0:
        # Idle time counts only while a replica is ready: a service whose replicas are
        # still loading (just created, or woken from zero) is not idle.
        history.last_busy = now
    else:
        # Nothing running, waiting or held: a burst is over, and so is a breach's floor.
        history.last_panic = history.guard_floor = None
    update_capacity(obs, policy, history)
    track_starts(obs, history)
    track_queues(obs, policy, history)
    capacity = capacity_for(obs, policy, history)
    estimate = None
    measuring = obs.counting and obs.demand is None and obs.num_ready > 0
    if measuring:
        up, up_reason, down = current, "measuring-demand", current
    elif capacity is not None and obs.demand is not None and obs.num_ready > 0:
        up, up_reason, down, estimate = sized(obs, policy, history, capacity)
    else:
        up, up_reason = recommend(obs, policy)
        down, _ = recommend(obs, policy, margin=SCALE_DOWN_MARGIN)
    keep = max(policy.scale_down_stabilization, policy.scale_up_stabilization)
    history.record(now, up, down, keep)
    floor = policy.min_replicas
    lo, hi = floor, policy.max_replicas

    def clamp(n: int) -> int:
        return max(lo, min(hi, n))

    def decision(desired: int, direction: str, reason: str) -> Decision:
        return Decision(desired, direction, reason, up, estimate)

    # A manual scale outside the bounds is brought back in.
    if current > hi:
        return decision(hi, "down", "above-max-replicas")
    if current < lo and not (current == 0 and lo == 0):
        return decision(lo, "up", "below-min-replicas")

    # Scale from zero: a request is waiting at a gateway.
    if current == 0:
        if obs.pending_requests > 0:
            return decision(clamp(max(1, up)), "up", "pending-requests")
        return decision(0, "none", "scaled-to-zero")

    # Scale to zero: idle for the whole idle time.
    if lo == 0 and not obs.busy:
        idle_for = now - (history.first_seen if history.last_busy is None else history.last_busy)
        if idle_for >= policy.scale_to_zero_idle:
            return decision(0, "down", "idle")

    if obs.num_ready == 0:
        return decision(current, "none", "no-ready-replica")

    # Demand comes at the next tick: the signals alone would read a backlog as demand again
    # (after an operator restart under load, straight to the maximum).
    if measuring:
        return decision(current, "none", "measuring-demand")

    # Up: what the load calls for now (and, with an up window, for all of it).
    target_up = up
    if policy.scale_up_stabilization > 0:
        window = [
            u for t, u, _ in history.recommendations if t >= now - policy.scale_up_stabilization
        ]
        covered = now - history.first_seen >= policy.scale_up_stabilization
        target_up = min(window) if covered else current
    if target_up > current and target_up - obs.num_ready > TOLERANCE * obs.num_ready:
        desired = clamp(min(target_up, current + policy.max_scale_up_step))
        if desired > current:
            history.starts.append((now, desired))
            history.last_up = now
            return decision(desired, "up", up_reason)

    # Down: every moment of the window allowed fewer replicas, with the margin; never while
    # a panic is recent.
    covered = now - history.first_seen >= policy.scale_down_stabilization
    window = [
        d for t, _, d in history.recommendations if t >= now - policy.scale_down_stabilization
    ]
    target_down = max(window) if window else current
    panicking = history.last_panic is not None and now - history.last_panic < policy.demand_window
    # A busy service is not scaled down within a demand window of a scale-up: until the window
    # has seen only the new count, it still holds the old one's arrivals, and a closed loop of
    # clients sends more once it is served faster (down, then up again: a flap).
    settling = (
        obs.busy and history.last_up is not None and now - history.last_up < policy.demand_window
    )
    if covered and target_down < current and not panicking and not settling:
        desired = clamp(max(target_down, current - policy.max_scale_down_step, 1))
        if desired < current:
            return decision(desired, "down", "below-targets-for-window")
    return decision(current, "none", "within-targets")
