"""Can a replica fit anywhere? A pure check of the spec against the cluster's nodes.

The schema cannot know the cluster; a replica asking for more GPUs than any eligible node has
would stay Pending forever, so the reconcile reports it as ``Degraded`` instead.
"""

from __future__ import annotations

from typing import Any

from conveyor.operator.runtime_manifests import GPU_RESOURCE
from conveyor.operator.status import Problem


def _matches(node: dict[str, Any], node_selector: dict[str, str]) -> bool:
    labels = node["metadata"].get("labels") or {}
    return all(labels.get(key) == value for key, value in node_selector.items())


def node_gpus(node: dict[str, Any]) -> int:
    """Allocatable ``nvidia.com/gpu`` of one Node (0 when it has none)."""
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    return int(str(allocatable.get(GPU_RESOURCE, "0")))


def gpu_problem(spec: dict[str, Any], nodes: list[dict[str, Any]]) -> Problem | None:
    """A Problem when one replica asks for more GPUs than the largest eligible node has."""
    wanted = int((spec.get("resources") or {}).get("gpus", 0))
    if wanted == 0:
        return None
    selector = (spec.get("placement") or {}).get("nodeSelector") or {}
    eligible = [
        n for n in nodes if _matches(n, selector) and not (n.get("spec") or {}).get("unschedulable")
    ]
    most = max((node_gpus(n) for n in eligible), default=0)
    if wanted <= most:
        return None
    where = f"nodes matching spec.placement.nodeSelector {selector}" if selector else "nodes"
    if most == 0:
        detail = f"no schedulable {where} advertise {GPU_RESOURCE}"
    else:
        detail = f"the largest of the schedulable {where} has {most}"
    return Problem(
        "InsufficientGPUs",
        f"each replica asks for {wanted} {GPU_RESOURCE} (spec.resources.gpus) but {detail}; "
        "lower spec.resources.gpus or add a node with enough GPUs",
    )
