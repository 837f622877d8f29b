"""Where a wake from zero spends its time: the request held at the gateway, the operator's
decision, the pod's scheduling and start, the runtime's own start-up, the first token.

While the one waking request runs, the LLMService and its pods are read every 0.1 s, and the
first moment each milestone is seen is kept (on the benchmark's clock, from the request's
send). Readiness can fall between two reads: the gateway forwards the held request the moment
the pod is Ready, and a short answer's first token may come before the next read. Then the pod's
own record of it (its Ready condition's ``lastTransitionTime``, to the second) is used. The runtime's ``ready in ...`` line (process start, imports, model load, KV cache) is
read from the pod's log: it splits the span from the container starting to the pod's
readiness.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from conveyor.bench.autoscale.cluster_env import Env
from conveyor.bench.autoscale.load import Recorder, one_request
from conveyor.contracts.pod_status import api_time, ready_condition
from conveyor.operator.names import COMPONENT_LABEL

RUNTIME_PODS = f"{COMPONENT_LABEL}=runtime"
"""The label selector of the runtime pods (the operator's own label)."""

MILESTONES: tuple[tuple[str, str], ...] = (
    ("decided", "the operator asked for a replica (spec.replicas 0 -> 1)"),
    ("pod_created", "the runtime pod exists"),
    ("scheduled", "the pod was bound to a node"),
    ("started", "its container runs"),
    ("ready", "the pod is Ready (its readiness probe passed)"),
)
"""(key, what it means), in the order a wake goes through them."""


def _waking_pods(env: Env) -> list[dict[str, Any]]:
    """The runtime pods that are not being deleted (one being deleted is not the wake)."""
    pods = env.api.get(
        f"/api/v1/namespaces/{env.namespace}/pods",
        labelSelector=RUNTIME_PODS,
    )["items"]
    return [pod for pod in pods if not pod["metadata"].get("deletionTimestamp")]


def seen_now(env: Env) -> set[str]:
    """The milestones the API shows at this moment."""
    seen: set[str] = set()
    if (env.llmservice().get("spec") or {}).get("replicas", 0) >= 1:
        seen.add("decided")
    for pod in _waking_pods(env):
        status = pod.get("status") or {}
        seen.add("pod_created")
        if (pod.get("spec") or {}).get("nodeName"):
            seen.add("scheduled")
        if any("running" in (c.get("state") or {}) for c in status.get("containerStatuses") or []):
            seen.add("started")
        if ready_condition(pod) is not None:
            seen.add("ready")
    return seen


def ready_since(env: Env) -> float | None:
    """When a waking pod turned Ready, as the API records it (the Ready condition's
    ``lastTransitionTime``: whole seconds, UNIX time), or None while none is Ready."""
    for pod in _waking_pods(env):
        condition = ready_condition(pod)
        if condition and condition.get("lastTransitionTime"):
            return api_time(str(condition["lastTransitionTime"])).timestamp()
    return None


def runtime_ready_line(env: Env) -> str | None:
    """The runtime's own start-up line from the ready pod's log, if it has one."""
    try:
        log = env.kubectl(
            "-n", env.namespace, "logs", "-l", RUNTIME_PODS,
            "-c", "runtime", "--tail", "-1",
        )  # fmt: skip
    except RuntimeError:
        return None
    lines = [ln for ln in log.splitlines() if "ready in " in ln]
    return lines[-1][lines[-1].index("ready in ") :] if lines else None


async def wake_timeline(env: Env, client: Any, max_tokens: int = 4) -> dict[str, Any]:
    """Send one request to the service scaled to zero; return the first token's time and the
    seconds from the send at which each milestone was first seen."""
    first_seen: dict[str, float] = {}
    stop = threading.Event()
    sent, sent_wall = time.monotonic(), time.time()

    def poll() -> None:
        while not stop.is_set() and len(first_seen) < len(MILESTONES):
            try:
                now_seen = seen_now(env)
            except Exception:  # an API hiccup: read again at the next poll
                now_seen = set()
            at = round(time.monotonic() - sent, 1)
            for key in now_seen:
                first_seen.setdefault(key, at)
            stop.wait(0.1)

    poller = asyncio.create_task(asyncio.to_thread(poll))
    wake = Recorder()
    await one_request(client, wake, max_tokens=max_tokens)
    stop.set()
    await poller
    first_token = wake.done[0][1] if wake.done else None
    if "ready" not in first_seen and (since := await asyncio.to_thread(ready_since, env)):
        # The reads missed it: the pod's own record, to the second, within what was seen.
        at = since - sent_wall
        if first_token is not None:
            at = min(at, first_token)
        first_seen["ready"] = round(max(at, first_seen.get("started", 0.0)), 1)
    out: dict[str, Any] = {
        "first_token_s": round(first_token, 1)
        if first_token is not None
        else f"failed ({wake.failures})"
    }
    out.update({key: first_seen.get(key) for key, _ in MILESTONES})
    out["runtime_start"] = await asyncio.to_thread(runtime_ready_line, env)
    return out


def spans(timeline: dict[str, Any]) -> list[str]:
    """One line per span between milestones, for the progress output."""
    lines, last, last_at = [], "request sent", 0.0
    for key, meaning in MILESTONES:
        at = timeline.get(key)
        if at is None:
            continue
        lines.append(f"  {at - last_at:5.1f} s  {last} -> {key}: {meaning}")
        last, last_at = key, at
    first = timeline.get("first_token_s")
    if isinstance(first, float):
        lines.append(f"  {first - last_at:5.1f} s  {last} -> first token")
    if timeline.get("runtime_start"):
        lines.append(f"  runtime: {timeline['runtime_start']}")
    return lines
