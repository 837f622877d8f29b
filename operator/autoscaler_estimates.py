"""The estimates the autoscaler's decision sizes from, each kept in its ``History``.

- one replica's capacity: measured from replicas that were saturated (not while overloaded,
  once measured without), else the spec's guess, else the busy replicas' throughput as a
  lower bound;
- how long a replica takes to be ready, learned from asking for replicas to their being ready;
- whether every replica has had a queue through the demand window (the fleet is saturated,
  so its arrivals may be its throughput, short of the demand);
- whether a queue, TTFT or KV target has stayed breached, with every replica ready, for half a
  demand window (by the median of its ticks).
"""

from __future__ import annotations

import math
import statistics

from conveyor.operator.autoscaler_model import AutoscalingPolicy, History, Observation, Rates

SATURATED = 0.9
"""Share of the demand window's ticks at which every ready replica must have had a queue for
the fleet to read as saturated (a tick between two of a client's requests may find one
without)."""
OVERLOADED = 0.25
"""A backlog growing faster than this share of what the ready replicas finish is an overload:
their throughput then is not taken as their capacity once a steady one was measured
(``update_capacity``)."""
DRAINING = 0.8
"""A backlog whose median over the later half of a breach's window is below this share of the
earlier half's is draining: no replica is added for that breach."""


def overloaded(obs: Observation, sample: Rates) -> bool:
    """Whether the backlog grew over the panic window by more than ``OVERLOADED`` of what the
    ready replicas finish (each at ``sample``): arrivals well beyond the fleet's throughput."""
    assert obs.demand is not None
    return obs.demand.backlog_growth > OVERLOADED * sample.requests * max(1, obs.num_ready)


def update_capacity(obs: Observation, policy: AutoscalingPolicy, history: History) -> None:
    """Fold a capacity measurement into the history: the first replaces the spec's guess, later
    ones are averaged with a time constant of the demand window (one tick's noise is damped,
    a new model or image is followed within a minute or two of saturation). A measurement
    weighs as the seconds since the last one, at most a panic window (what it covers): one
    taken after minutes without any is one replica's few seconds, not minutes of evidence (a
    replica that stalled for 6 s beside a busy start read 4.85 requests/s, and replaced a
    7.22 measured three minutes before).

    A measurement taken while the fleet is overloaded (``overloaded``) understates what a
    replica carries once the fleet is sized: a replica also accepts, parses and tokenizes the
    requests it cannot serve yet, on the CPU its engine uses (a quarter-core replica
    finished 7.2 requests/s under a 2x step, 8.05 under a steady queue, so the step read as
    2.2 replicas and settled at 3). Such measurements are used only until one without
    overload comes, which replaces them; after that they are left out. A measurement covers
    the panic window, so one is steady only a panic window after the last overload: one
    taken as the backlog drains still holds the overloaded seconds (7.5 where the replicas
    then did 8), and averaged in, the steady figure would take minutes to come."""
    busy = obs.demand.busy if obs.demand is not None else None
    floor = history.capacity_floor
    if busy is not None and busy.requests > 0 and (floor is None or busy.requests > floor.requests):
        # Each busy reading is a lower bound of one figure: the tightest is the highest seen.
        # A replica at 40% that had a queue for one tick reads far below its capacity (1.6
        # requests/s at 85% of one replica of 8, spread over two), and taken alone it asked
        # for 5 replicas where the step before had shown 8.
        history.capacity_floor = busy
    sample = obs.demand.saturated if obs.demand is not None else None
    if sample is None or sample.requests <= 0:
        return
    if overloaded(obs, sample):
        history.last_overload = obs.time
    last = history.last_overload
    steady = last is None or obs.time - last >= policy.panic_window
    if not steady and history.capacity_steady:
        return
    old, then = history.capacity, history.capacity_time
    first_steady = steady and not history.capacity_steady
    history.capacity_steady = history.capacity_steady or steady
    if old is None or then is None or first_steady:
        history.capacity = sample
    else:
        span = min(max(0.0, obs.time - then), policy.panic_window)
        a = 1.0 - math.exp(-span / policy.demand_window)
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
    floor = history.capacity_floor  # the highest a busy replica showed (update_capacity)
    if busy is not None and floor is not None:
        return floor, "lower-bound"
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
    ratios = [(obs.queued / n / policy.target_queue_depth, "queue-depth")]
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
    median over the later half a fifth below the earlier half's) a lasting breach. Ticks
    with a replica not ready (starting, or its scrape missed) are left out; a change of
    count starts afresh.
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
    """Record whether every ready replica has a queue now (ticks without one say nothing).
    Requests held at a gateway are a queue for every replica: it holds them only while each
    has its batch full and its own allowance waiting (``--queue-at-gateway``)."""
    if obs.num_ready == 0:
        return
    held = obs.pending_requests > 0
    history.queued.append((obs.time, held or all(r.waiting > 0 for r in obs.ready)))
    while history.queued[0][0] < obs.time - policy.demand_window:
        history.queued.popleft()
    history.queue_depths.append((obs.time, obs.queued))
    while history.queue_depths[0][0] < obs.time - policy.panic_window:
        history.queue_depths.popleft()


def steady_queue(obs: Observation, history: History) -> float:
    """The requests queued or held, averaged over the ticks of the last panic window: what a
    scale-down is held by. A tick's reading is spiky: a replica counts a request that came
    during a step as waiting until its next step, whatever room it has, and over a 300 s
    window a scale-down held by the highest tick never came (4 replicas at 61% stayed at 4
    for 8 minutes of a 3x step, where 3 would run at 80%)."""
    if not history.queue_depths or history.queue_depths[-1][0] != obs.time:
        return float(obs.queued)
    return sum(q for _, q in history.queue_depths) / len(history.queue_depths)


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
