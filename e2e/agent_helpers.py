"""Helpers for the node agent's end-to-end tests: pod manifests, waits on pod status, the agent.

Waits poll the real API with a deadline (``wait_for``); nothing here sleeps to synchronise.
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from conveyor.cluster import Cluster
from conveyor.cluster.agent_process import AGENT_NAME
from conveyor.cluster.api import ApiClient, ApiError, wait_for
from conveyor.cluster.process import ManagedProcess
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


def get_pod(api: ApiClient, namespace: str, name: str) -> dict:
    return api.get(f"/api/v1/namespaces/{namespace}/pods/{name}")


def container_status(p: dict) -> dict:
    return ((p.get("status") or {}).get("containerStatuses") or [{}])[0]


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
        last = get_pod(api, namespace, name)
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


def wait_gone(api: ApiClient, namespace: str, name: str, timeout_s: float = TIMEOUT_S) -> None:
    def gone() -> bool:
        try:
            get_pod(api, namespace, name)
        except ApiError as exc:
            if exc.status == 404:
                return True
            raise
        return False

    wait_for(f"pod {name} gone", gone, timeout_s=timeout_s, interval_s=0.05)


def http_get(url: str, timeout_s: float = 5) -> str:
    """GET without any proxy (pod and Service addresses stay on the bridge)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=timeout_s) as resp:
        return resp.read().decode()


def agent_process(cluster: Cluster) -> ManagedProcess | None:
    """The cluster's node agent, when it runs."""
    proc = cluster.processes.get(AGENT_NAME)
    return proc if proc is not None and proc.alive() else None


def ensure_node_agent(cluster: Cluster) -> ManagedProcess:
    """The cluster's node agent; started (as the cluster's process) when the cluster has none."""
    proc = agent_process(cluster)
    if proc is None:
        if cluster.state is None:
            raise RuntimeError("the cluster is not started")
        cluster.state.processes = [p for p in cluster.state.processes if p.name != AGENT_NAME]
        cluster._start_node_agent()
        proc = cluster.processes[AGENT_NAME]
    return proc


def mounts_below(directory: Path) -> list[str]:
    """Mount points under ``directory`` in the host's mount namespace."""
    prefix = str(directory)
    return [
        line.split()[4]
        for line in Path("/proc/self/mountinfo").read_text().splitlines()
        if line.split()[4].startswith(prefix)
    ]


def elapsed_since(t0: float) -> float:
    return time.monotonic() - t0
