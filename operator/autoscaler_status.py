"""What the autoscaler says about a decision: ``status.autoscaler``, the values of the
``conveyor_autoscaler_signal`` and ``_target`` series, and the sentence of a scale Event.
Pure functions of the observation, the policy and the decision.
"""

from __future__ import annotations

from typing import Any

from conveyor.operator.autoscaler_model import AutoscalingPolicy, Decision, Observation


def status_signals(obs: Observation) -> dict[str, Any]:
    """``status.autoscaler.signals`` (printer columns read two of them)."""
    n = obs.num_ready
    out: dict[str, Any] = {
        "readyReplicas": n,
        "queueDepthPerReplica": round(obs.queued / n, 3) if n else 0.0,
        "runningPerReplica": round(obs.running / n, 3) if n else 0.0,
        "kvCacheUsage": round(sum(r.kv_cache_usage for r in obs.ready) / n, 4) if n else 0.0,
        "pendingRequests": obs.pending_requests,
    }
    if obs.ttft_p95 is not None:
        out["ttftP95Seconds"] = round(obs.ttft_p95, 4)
    return out


ESTIMATE_SIGNALS = (
    "demandRequestsPerSecond",
    "demandTokensPerSecond",
    "utilization",
    "replicasNeeded",
    "panic",
    "replicaStartSeconds",
    "burstRequestsPerSecond",
    "burstReplicasNeeded",
)
"""Keys of ``status.autoscaler.signals`` that only a capacity-sized decision has."""


def autoscaler_status(
    obs: Observation,
    decision: Decision,
    *,
    now: str,
    last_scale_time: str | None,
    capacity_time: str | None = None,
) -> dict[str, Any]:
    """``status.autoscaler``: the decision, its signals and, when it was sized by capacity,
    the demand, utilization and the capacity it used (with where that came from)."""
    status: dict[str, Any] = {
        "lastDecisionTime": now,
        "desiredReplicas": decision.desired,
        "direction": decision.direction,
        "reason": decision.reason,
        "signals": status_signals(obs),
    }
    if decision.held_by is not None:
        status["scaleDownHeldBy"] = decision.held_by
    est = decision.estimate
    if est is not None:
        status["signals"].update({
            "demandRequestsPerSecond": round(est.demand.requests, 3),
            "demandTokensPerSecond": round(est.demand.tokens, 1),
            "utilization": round(est.utilization, 3),
            "replicasNeeded": round(est.replicas_needed, 3),
            "panic": est.panic,
        })  # fmt: skip
        if est.start_time is not None:
            status["signals"]["replicaStartSeconds"] = round(est.start_time, 1)
        if est.burst is not None and est.burst_replicas_needed is not None:
            status["signals"]["burstRequestsPerSecond"] = round(est.burst.requests, 3)
            status["signals"]["burstReplicasNeeded"] = round(est.burst_replicas_needed, 3)
        capacity: dict[str, Any] = {
            "requestsPerSecond": round(est.capacity.requests, 3),
            "tokensPerSecond": round(est.capacity.tokens, 1),
            "source": est.capacity_source,
        }
        if capacity_time is not None and est.capacity_source in ("measured", "status"):
            capacity["lastMeasuredTime"] = capacity_time
        status["capacity"] = capacity
    if last_scale_time is not None:
        status["lastScaleTime"] = last_scale_time
    return status


SIGNAL_NAMES = (
    "queue_depth_per_replica",
    "ttft_p95_seconds",
    "kv_cache_usage",
    "demand_requests_per_second",
    "demand_tokens_per_second",
    "capacity_requests_per_second",
    "capacity_tokens_per_second",
    "utilization",
    "replicas_needed",
    "replica_start_seconds",
)
"""Values of ``conveyor_autoscaler_signal{signal}``; those after the first three are NaN
while the decision is the signals' own (no capacity figure or no demand yet)."""


def signal_values(
    obs: Observation, policy: AutoscalingPolicy, decision: Decision
) -> tuple[dict[str, float | None], dict[str, float | None]]:
    """``conveyor_autoscaler_signal`` and ``conveyor_autoscaler_target`` by signal (None: NaN,
    or no target series)."""
    n, est = obs.num_ready, decision.estimate
    values = {
        "queue_depth_per_replica": obs.queued / n if n else 0.0,
        "ttft_p95_seconds": obs.ttft_p95,
        "kv_cache_usage": sum(r.kv_cache_usage for r in obs.ready) / n if n else 0.0,
        "demand_requests_per_second": None if est is None else est.demand.requests,
        "demand_tokens_per_second": None if est is None else est.demand.tokens,
        "capacity_requests_per_second": None if est is None else est.capacity.requests,
        "capacity_tokens_per_second": None if est is None else est.capacity.tokens,
        "utilization": None if est is None else est.utilization,
        "replicas_needed": None if est is None else est.replicas_needed,
        "replica_start_seconds": None if est is None else est.start_time,
    }
    targets = {
        "queue_depth_per_replica": policy.target_queue_depth,
        "ttft_p95_seconds": policy.target_ttft_p95,
        "kv_cache_usage": policy.target_kv_cache_usage,
        "utilization": policy.target_utilization,
    }
    return values, targets


def describe(obs: Observation, policy: AutoscalingPolicy, decision: Decision) -> str:
    """The decision in a sentence, for the log and the scale Event."""
    n, est = obs.num_ready, decision.estimate
    parts = [
        f"{n} ready",
        f"queue {obs.queued / n if n else 0:.1f}/replica (target {policy.target_queue_depth:g})",
    ]
    if est is not None:
        parts.append(
            f"demand {est.demand.requests:.2f} req/s over capacity {est.capacity.requests:.2f} "
            f"req/s per replica ({est.capacity_source}): {est.replicas_needed:.2f} replicas"
            + (", panic" if est.panic else "")
        )
    if obs.ttft_p95 is not None:
        target = "none" if policy.target_ttft_p95 is None else f"{policy.target_ttft_p95:g}s"
        parts.append(f"TTFT p95 {obs.ttft_p95:.2f}s (target {target})")
    if obs.pending_requests:
        parts.append(f"{obs.pending_requests} held at the gateway")
    return ", ".join(parts)


def without_time(status: dict[str, Any]) -> dict[str, Any]:
    """``status.autoscaler`` but for its time: a tick with nothing new writes nothing."""
    return {k: v for k, v in status.items() if k != "lastDecisionTime"}
