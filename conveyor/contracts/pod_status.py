"""What the autoscaler and the benchmarks read of a pod's status from the Kubernetes API: its
Ready condition, and the API's timestamps (RFC 3339, whole seconds, UTC).

Torch-free and component-free, like every contract: the operator (how long replicas take to
start) and ``conveyor bench autoscale`` (when a woken pod turned Ready) read the same fields
through it.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any


def ready_condition(pod: dict[str, Any]) -> dict[str, Any] | None:
    """The pod's Ready condition when it is True; None otherwise."""
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "Ready" and c.get("status") == "True":
            return dict(c)
    return None


def api_time(stamp: str) -> datetime:
    """An API timestamp (``2026-12-06T01:00:12Z``) as an aware datetime."""
    return datetime.fromisoformat(stamp.replace("Z", "+00:00"))
