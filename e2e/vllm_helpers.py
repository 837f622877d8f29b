"""The vLLM LLMService that ``test_engines`` serves for the whole module: its spec and
the operator's flags for it, and how a test reads its pods, its gateway and its autoscaler."""

from __future__ import annotations

import re
from typing import Any

import httpx
from operator_helpers import LLMSERVICES, OperatorProcess, llmservice_status

from conveyor.cluster.testing import KubeUnderTest
from conveyor.observability import names as n

NAME = "vllm-tiny"
REPLICA = {"gpus": 1, "memory": "6Gi"}
"""One simulated GPU; no CPU limit, so vLLM's start-up (a minute or more) uses every core."""
RUNTIME = {
    "maxRunningRequests": 2,
    "extraArgs": ["--enforce-eager"],
    "env": [
        {"name": "VLLM_CPU_OMP_THREADS_BIND", "value": "nobind"},
        {"name": "OMP_NUM_THREADS", "value": "1"},
    ],
}
"""Two sequences at a time, so a few concurrent requests queue (vLLM's waiting gauge moves);
eager mode skips vLLM's compilation at start (it serves the same). One unbound compute thread
per replica: two replicas share this machine's two cores, and vLLM's default (OpenMP threads
bound to every core, waiting by spinning) made a second replica starting beside a busy first
one take over ten minutes."""
READY_S = 600
OPERATOR_FLAGS = (
    "--autoscale-interval", "1", "--gateway-hold-timeout", str(READY_S),
    "--lease-duration", "60", "--lease-renew-interval", "10", "--lease-retry-interval", "2",
)  # fmt: skip
"""Decide every second; the gateway holds a request while a vLLM replica starts from zero
(a minute or more here). A long Lease, not the e2e helpers' short one (made for fast takeover
tests): with two vLLM replicas busy on both cores the apiserver once left a renewal unanswered
for over 10 s (the default deadline), the operator stepped down as it should, and nothing
here restarts it as a Deployment would."""
AUTOSCALING = {
    "enabled": True, "minReplicas": 1, "maxReplicas": 2, "targetQueueDepthPerReplica": 2,
    "scaleDownStabilizationSeconds": 10,
}  # fmt: skip
CLIENTS = 10
"""Clients sending back to back: five times vLLM's batch (2), so one replica queues about 8,
four times the autoscaler's target."""
SMOLLM2 = "smollm2-135m-instruct"
NO_PROXY = httpx.Client(trust_env=False, timeout=30)


def ready_status(kube: KubeUnderTest, namespace: str, op: OperatorProcess) -> Any:
    if op.proc.poll() is not None:
        raise AssertionError(f"the operator exited:\n{op.logs()}")
    for pod in kube.api.get(f"/api/v1/namespaces/{namespace}/pods")["items"]:
        for c in (pod.get("status") or {}).get("containerStatuses") or []:
            last = (c.get("lastState") or {}).get("terminated")
            if last and c.get("restartCount", 0) >= 2:
                name = pod["metadata"]["name"]
                logs = kube.kubectl(
                    "-n", namespace, "logs", name, "-c", c["name"], "--previous", "--tail", "150",
                    check=False,
                )  # fmt: skip
                raise AssertionError(
                    f"container {c['name']} of {name} keeps exiting (code "
                    f"{last.get('exitCode')}); the last lines of its last run:\n"
                    f"{logs.stdout}{logs.stderr}"
                )
    status = llmservice_status(kube.api, namespace, NAME)
    if status.get("phase") == "Ready" and (status.get("endpoint") or {}).get("clusterIP"):
        return status
    return None


def runtime_pods(kube: KubeUnderTest, namespace: str) -> list[dict[str, Any]]:
    return kube.api.get(
        f"/api/v1/namespaces/{namespace}/pods",
        labelSelector=f"conveyor.dev/llmservice={NAME}",
    )["items"]


def gateway_url(kube: KubeUnderTest, namespace: str) -> str:
    (pod,) = kube.api.get(
        f"/api/v1/namespaces/{namespace}/pods",
        labelSelector="app.kubernetes.io/component=gateway",
    )["items"]
    return f"http://{pod['status']['podIP']}:8080"


def patch_spec(kube: KubeUnderTest, namespace: str, spec: dict[str, Any]) -> None:
    kube.api.merge_patch(f"{LLMSERVICES.format(ns=namespace)}/{NAME}", {"spec": spec})


def requests_per_replica(gateway: str) -> dict[str, float]:
    """Requests the gateway answered, per replica it sent them to."""
    found: dict[str, float] = {}
    for line in NO_PROXY.get(f"{gateway}/metrics").text.splitlines():
        if line.startswith(f"{n.GW_REQUESTS}{{"):
            backend = re.search(r'backend="([^"]*)"', line)
            if backend and backend.group(1):
                found[backend.group(1)] = found.get(backend.group(1), 0.0) + float(
                    line.rsplit(" ", 1)[1]
                )
    return found


def runtime_logs(kube: KubeUnderTest, namespace: str) -> str:
    """The last lines of every runtime container, this run's and the one before."""
    out = []
    for pod in runtime_pods(kube, namespace):
        for previous in ("--previous", ""):
            logs = kube.kubectl(
                "-n", namespace, "logs", pod["metadata"]["name"], "-c", "runtime", "--tail", "400",
                *([previous] if previous else []), check=False,
            )  # fmt: skip
            out.append(f"--- {pod['metadata']['name']} {previous}\n{logs.stdout}{logs.stderr}")
    return "\n".join(out)


def autoscaler_signals(kube: KubeUnderTest, namespace: str) -> dict[str, Any]:
    status = llmservice_status(kube.api, namespace, NAME)
    return (status.get("autoscaler") or {}).get("signals") or {}


def replicas(kube: KubeUnderTest, namespace: str) -> tuple[int, int]:
    """(spec.replicas, status.readyReplicas) of the LLMService."""
    obj = kube.api.get(f"{LLMSERVICES.format(ns=namespace)}/{NAME}")
    return obj["spec"].get("replicas", 1), (obj.get("status") or {}).get("readyReplicas", 0)
