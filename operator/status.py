"""Pure status of an LLMService: phase, replica counts, conditions, endpoint.

Computed from the LLMService, its runtime Deployment (as the apiserver reports it) and what
the reconcile found (a spec that cannot run); the handlers patch the result. The autoscaler
(``autoscaler_timer.py``) writes ``status.autoscaler`` itself and never touches these fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from conveyor.operator.names import runtime_selector, selector_string
from conveyor.operator.runtime_manifests import desired_replicas


@dataclass(frozen=True)
class Problem:
    """Why a spec that passed the schema cannot run (status condition Degraded)."""

    reason: str
    """CamelCase, as Kubernetes condition reasons are (e.g. InsufficientGPUs)."""
    message: str
    """What is wrong and what to change."""


def _condition(kind: str, ok: bool, reason: str, message: str) -> dict[str, Any]:
    return {"type": kind, "status": "True" if ok else "False", "reason": reason, "message": message}


def merge_conditions(
    previous: list[dict[str, Any]], current: list[dict[str, Any]], now: str, generation: int
) -> list[dict[str, Any]]:
    """``current`` with lastTransitionTime kept from ``previous`` where the status did not change."""
    before = {c.get("type"): c for c in previous or []}
    merged = []
    for cond in current:
        old = before.get(cond["type"])
        since = (
            old.get("lastTransitionTime") if old and old.get("status") == cond["status"] else None
        )
        merged.append(
            {**cond, "lastTransitionTime": since or now, "observedGeneration": generation}
        )
    return merged


def _deployment_problem(deployment: dict[str, Any]) -> Problem | None:
    for cond in (deployment.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded":
            return Problem("ProgressDeadlineExceeded", cond.get("message", "rollout stalled"))
        if cond.get("type") == "ReplicaFailure" and cond.get("status") == "True":
            return Problem(cond.get("reason") or "ReplicaFailure", cond.get("message", ""))
    return None


def llmservice_status(
    llmservice: dict[str, Any],
    deployment: dict[str, Any] | None,
    *,
    problem: Problem | None,
    endpoint: dict[str, Any] | None,
    now: str,
) -> dict[str, Any]:
    """The status fields the reconcile owns (everything but ``autoscaler``)."""
    meta, spec = llmservice["metadata"], llmservice["spec"]
    generation = int(meta.get("generation", 1))
    desired = desired_replicas(spec)
    dep_status = (deployment or {}).get("status") or {}
    replicas = int(dep_status.get("replicas", 0))
    ready = int(dep_status.get("readyReplicas", 0))
    updated = int(dep_status.get("updatedReplicas", 0))
    dep_meta = (deployment or {}).get("metadata") or {}
    rolled_out = (
        deployment is not None
        and int(dep_status.get("observedGeneration", 0)) >= int(dep_meta.get("generation", 1))
        and (deployment.get("spec") or {}).get("replicas") == desired
        and updated == desired
        and ready >= desired
        and replicas == desired  # old replicas gone
    )
    problem = problem or (_deployment_problem(deployment) if deployment else None)

    if problem is not None:
        phase = "Degraded"
    elif desired == 0:
        phase = "ScaledToZero"
    elif rolled_out:
        phase = "Ready"
    elif ready == 0:
        phase = "Pending"
    else:
        phase = "Progressing"

    if ready > 0:
        ready_cond = _condition("Ready", True, "ReplicasReady", f"{ready}/{desired} replicas ready")
    elif desired == 0:
        ready_cond = _condition("Ready", False, "ScaledToZero", "no replicas wanted")
    else:
        ready_cond = _condition("Ready", False, "NoReadyReplica", f"0/{desired} replicas ready")
    if rolled_out or (desired == 0 and replicas == 0):
        progressing = _condition(
            "Progressing", False, "RolloutComplete", "every replica runs the current spec"
        )
    else:
        progressing = _condition(
            "Progressing", True, "RollingOut",
            f"{updated} updated, {ready} ready, {replicas} running of {desired} desired",
        )  # fmt: skip
    degraded = (
        _condition("Degraded", True, problem.reason, problem.message)
        if problem
        else _condition("Degraded", False, "AsExpected", "the spec can run")
    )
    previous = (llmservice.get("status") or {}).get("conditions") or []
    status: dict[str, Any] = {
        "phase": phase,
        "replicas": replicas,
        "readyReplicas": ready,
        "updatedReplicas": updated,
        "desiredReplicas": desired,
        "selector": selector_string(runtime_selector(meta["name"])),
        "observedGeneration": generation,
        "conditions": merge_conditions(
            previous, [ready_cond, progressing, degraded], now, generation
        ),
    }
    if endpoint is not None:
        status["endpoint"] = endpoint
    return status


def status_changed(old: dict[str, Any], new: dict[str, Any]) -> bool:
    """Whether patching ``new`` over ``old`` would change anything (ignores other writers' fields)."""
    return any(old.get(key) != value for key, value in new.items())
