"""Helpers of the e2e tests that make pods themselves: a pod manifest, its creation, waits on
its status, and a GET that bypasses any proxy.

Waits poll the real API with a deadline (``wait_for``); nothing here sleeps to synchronise.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Callable
from typing import Any

from conveyor.cluster.api import ApiClient, wait_for
from conveyor.operator.names import IMAGE

TIMEOUT_S = 120


def pod(
    name: str, command: list[str], *, labels: dict[str, str] | None = None, **container: Any
) -> dict:
    """A one-container pod of the ``conveyor`` image; ``spec`` keys go in ``container['pod_spec']``."""
    pod_spec = container.pop("pod_spec", {})
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {"app": name}},
        "spec": {
            "terminationGracePeriodSeconds": 5,
            "containers": [{"name": "main", "image": IMAGE, "command": command, **container}],
            **pod_spec,
        },
    }


def create(api: ApiClient, namespace: str, manifest: dict) -> dict:
    kind = manifest["kind"].lower() + "s"
    group = manifest["apiVersion"]
    base = f"/api/{group}" if "/" not in group else f"/apis/{group}"
    return api.create(f"{base}/namespaces/{namespace}/{kind}", manifest)


def wait_pod(
    api: ApiClient,
    namespace: str,
    name: str,
    what: str,
    check: Callable[[dict], Any],
    timeout_s: float = TIMEOUT_S,
) -> dict:
    """Poll the pod until ``check(pod)`` is truthy; the pod then. The last status comes with a timeout."""
    last: dict = {}

    def probe() -> Any:
        nonlocal last
        last = api.get(f"/api/v1/namespaces/{namespace}/pods/{name}")
        return last if check(last) else None

    try:
        return wait_for(f"pod {name}: {what}", probe, timeout_s=timeout_s, interval_s=0.05)
    except TimeoutError as exc:
        raise TimeoutError(f"{exc}; last status: {last.get('status')}") from None


def is_ready(p: dict) -> bool:
    return any(
        c["type"] == "Ready" and c["status"] == "True"
        for c in (p.get("status") or {}).get("conditions") or []
    )


def wait_ready(api: ApiClient, namespace: str, name: str, timeout_s: float = TIMEOUT_S) -> dict:
    return wait_pod(api, namespace, name, "Ready", is_ready, timeout_s)


def wait_phase(
    api: ApiClient, namespace: str, name: str, *phases: str, timeout_s: float = TIMEOUT_S
) -> dict:
    return wait_pod(
        api,
        namespace,
        name,
        f"phase in {phases}",
        lambda p: (p.get("status") or {}).get("phase") in phases,
        timeout_s,
    )


def http_get(url: str, timeout_s: float = 5) -> str:
    """GET without any proxy (pod and Service addresses stay on the bridge)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=timeout_s) as resp:
        return resp.read().decode()
