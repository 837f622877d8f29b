"""The autoscaler's decision: a pure function of signals, policy and history.

    decide(observation, policy, history) -> Decision(desired, direction, reason)

Up is prompt: when the queue per ready replica, TTFT p95 or KV-cache usage is
above its target, the replica count the load calls for is computed in one go
(``ceil(ready * signal / target)``, as the HPA does), not one replica per
period. Down is patient: only when every signal stayed below its target with a
margin for the whole stabilization window, to the largest count any moment of
that window called for. Replicas still loading count neither as capacity nor
as idle, and never freeze a decision.

No Kubernetes, no clock, no I/O: the kopf timer gathers an ``Observation``,
calls ``decide``, and writes the result.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

SCALE_DOWN_MARGIN = 0.8
"""Signals must be below target x this for a scale-down (hysteresis against flapping)."""
TOLERANCE = 0.1
"""Ignore a computed change of less than 10% of the ready replicas (the HPA's default)."""


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

    @classmethod
    def from_spec(cls, spec: dict[str, Any] | None) -> AutoscalingPolicy:
        s = spec or {}
        d = cls()
        ttft = s.get("targetTTFTP95Seconds")
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
        )


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
    def busy(self) -> bool:
        return self.waiting > 0 or self.running > 0 or self.pending_requests > 0


@dataclass(frozen=True)
class Decision:
    desired: int
    direction: str  # "up", "down" or "none"
    reason: str
    recommendation: int
    """What the load alone calls for now (before bounds, windows and step limits)."""


@dataclass
class History:
    """What ``decide`` remembers between calls (one per LLMService, kept by the timer)."""

    recommendations: deque[tuple[float, int, int]] = field(default_factory=deque)
    """(time, recommended replicas for scale-up, for scale-down with the margin)."""
    last_busy: float | None = None
    """Last time any request was running, waiting or pending, or no replica was ready."""
    first_seen: float | None = None

    def record(self, time: float, up: int, down: int, keep: float) -> None:
        self.recommendations.append((time, up, down))
        while self.recommendations and self.recommendations[0][0] < time - keep:
            self.recommendations.popleft()


def recommend(obs: Observation, policy: AutoscalingPolicy, margin: float = 1.0) -> tuple[int, str]:
    """Replicas the current load calls for, and the signal that calls for the most.

    ``margin`` < 1 lowers every target: the count at which all signals sit
    below ``target x margin``, which is what a scale-down must satisfy.
    """
    ready = obs.num_ready
    if ready == 0:
        return (1 if obs.pending_requests else 0), "pending-requests"
    candidates = [(0, "idle")]
    q_target = policy.target_queue_depth * margin
    candidates.append((math.ceil(obs.waiting / q_target), "queue-depth"))
    if policy.target_ttft_p95 is not None and obs.ttft_p95 is not None:
        ratio = obs.ttft_p95 / (policy.target_ttft_p95 * margin)
        candidates.append((math.ceil(ready * ratio), "ttft-p95"))
    kv = sum(r.kv_cache_usage for r in obs.ready) / ready
    candidates.append((math.ceil(ready * kv / (policy.target_kv_cache_usage * margin)), "kv-cache"))
    # Requests in flight need slots: keep enough replicas for them.
    slots = max(1, min(r.max_running for r in obs.ready))
    candidates.append((math.ceil(obs.running / (slots * margin)), "running"))
    if obs.pending_requests:
        candidates.append((1, "pending-requests"))
    return max(candidates)


def decide(obs: Observation, policy: AutoscalingPolicy, history: History) -> Decision:
    now, current = obs.time, obs.current_replicas
    if history.first_seen is None:
        history.first_seen = now
    if obs.busy or obs.num_ready == 0:
        # Idle time counts only while a replica is ready: a service whose replicas are
        # still loading (just created, or woken from zero) is not idle.
        history.last_busy = now
    up, up_reason = recommend(obs, policy)
    down, _ = recommend(obs, policy, margin=SCALE_DOWN_MARGIN)
    keep = max(policy.scale_down_stabilization, policy.scale_up_stabilization)
    history.record(now, up, down, keep)
    floor = policy.min_replicas
    lo, hi = floor, policy.max_replicas

    def clamp(n: int) -> int:
        return max(lo, min(hi, n))

    # A manual scale outside the bounds is brought back in.
    if current > hi:
        return Decision(hi, "down", "above-max-replicas", up)
    if current < lo and not (current == 0 and lo == 0):
        return Decision(lo, "up", "below-min-replicas", up)

    # Scale from zero: a request is waiting at a gateway.
    if current == 0:
        if obs.pending_requests > 0:
            return Decision(clamp(max(1, up)), "up", "pending-requests", up)
        return Decision(0, "none", "scaled-to-zero", up)

    # Scale to zero: idle for the whole idle time.
    if lo == 0 and not obs.busy:
        idle_for = now - (history.first_seen if history.last_busy is None else history.last_busy)
        if idle_for >= policy.scale_to_zero_idle:
            return Decision(0, "down", "idle", up)

    if obs.num_ready == 0:
        return Decision(current, "none", "no-ready-replica", up)

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
            return Decision(desired, "up", up_reason, up)

    # Down: every moment of the window allowed fewer replicas, with the margin.
    covered = now - history.first_seen >= policy.scale_down_stabilization
    window = [
        d for t, _, d in history.recommendations if t >= now - policy.scale_down_stabilization
    ]
    target_down = max(window) if window else current
    if covered and target_down < current:
        desired = clamp(max(target_down, current - policy.max_scale_down_step, 1))
        if desired < current:
            return Decision(desired, "down", "below-targets-for-window", up)
    return Decision(current, "none", "within-targets", up)
