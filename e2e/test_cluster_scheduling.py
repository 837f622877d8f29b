"""GPU scheduling on the cluster's nodes (fake GPUs): the real scheduler, the real admission plugins."""

from __future__ import annotations

import pytest

from conveyor.cluster import Cluster
from conveyor.cluster.nodes import GPU_RESOURCE
from conveyor.cluster.testing import KubeUnderTest
from conveyor.operator.names import IMAGE

TIMEOUT_S = 90


def _pod_template(labels: dict[str, str], gpus: int | None) -> dict:
    resources = {"requests": {"cpu": "10m", "memory": "16Mi"}}
    if gpus is not None:
        resources = {
            "requests": {"cpu": "10m", "memory": "16Mi"},
            "limits": {GPU_RESOURCE: str(gpus)},
        }
    return {
        "metadata": {"labels": labels},
        "spec": {"containers": [{"name": "main", "image": IMAGE, "resources": resources}]},
    }


def _deployment(name: str, replicas: int, gpus: int | None) -> dict:
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": _pod_template(labels, gpus),
        },
    }


def _pods(kube: KubeUnderTest, namespace: str, app: str) -> list[dict]:
    return kube.api.get(f"/api/v1/namespaces/{namespace}/pods", labelSelector=f"app={app}")["items"]


def _condition(pod: dict, kind: str) -> dict | None:
    return next((c for c in pod.get("status", {}).get("conditions", []) if c["type"] == kind), None)


def _free_gpus(kube: KubeUnderTest) -> dict[str, int]:
    """GPUs each node has left: allocatable minus what the pods bound to it ask for."""
    free = {
        n["metadata"]["name"]: int(n["status"]["allocatable"][GPU_RESOURCE])
        for n in kube.api.get("/api/v1/nodes")["items"]
        if GPU_RESOURCE in n["status"].get("allocatable", {})
    }
    for pod in kube.api.get("/api/v1/pods")["items"]:
        node = pod["spec"].get("nodeName")
        if node in free and pod["status"].get("phase") not in ("Succeeded", "Failed"):
            for c in pod["spec"]["containers"]:
                resources = c.get("resources", {})
                asked = resources.get("limits", {}).get(GPU_RESOURCE) or resources.get(
                    "requests", {}
                ).get(GPU_RESOURCE)
                free[node] -= int(asked or 0)
    return free


def test_gpu_deployment_lands_on_gpu_nodes_and_tolerates_their_taint(
    kube: KubeUnderTest, own_cluster: Cluster, namespace: str
) -> None:
    cluster = own_cluster
    gpu_nodes, _ = cluster.node_names()
    free = _free_gpus(kube)
    if sum(f // 4 for f in free.values()) < 2:
        # Only on a cluster shared with other work (one left running by `conveyor cluster
        # up`); the session's own cluster frees every test's GPUs.
        pytest.skip(f"GPUs free per node {free}: other workloads on this cluster hold the rest")
    kube.api.create(
        f"/apis/apps/v1/namespaces/{namespace}/deployments", _deployment("llm", 2, gpus=4)
    )

    def scheduled() -> list[dict] | None:
        pods = _pods(kube, namespace, "llm")
        return pods if len(pods) == 2 and all(p["spec"].get("nodeName") for p in pods) else None

    pods = kube.api.wait_for("both GPU pods scheduled", scheduled, timeout_s=TIMEOUT_S)
    for pod in pods:
        assert pod["spec"]["nodeName"] in gpu_nodes
        # Nobody wrote this toleration: the ExtendedResourceToleration admission plugin did.
        assert {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"} in pod["spec"][
            "tolerations"
        ]
    # The deployment as a user sees it.
    out = kube.kubectl("get", "pods", "-n", namespace, "-o", "wide").stdout
    assert "gpu-node-" in out


def test_too_many_gpus_stays_pending_with_the_schedulers_reason(
    kube: KubeUnderTest, own_cluster: Cluster, namespace: str
) -> None:
    cluster = own_cluster
    too_many = cluster.settings.gpus_per_node + 1
    kube.api.create(
        f"/apis/apps/v1/namespaces/{namespace}/deployments", _deployment("huge", 1, gpus=too_many)
    )

    def unschedulable() -> dict | None:
        for pod in _pods(kube, namespace, "huge"):
            cond = _condition(pod, "PodScheduled")
            if cond and cond["status"] == "False" and cond.get("reason") == "Unschedulable":
                return pod
        return None

    pod = kube.api.wait_for(
        "the pod to be marked Unschedulable", unschedulable, timeout_s=TIMEOUT_S
    )
    assert pod["status"]["phase"] == "Pending"
    assert not pod["spec"].get("nodeName")
    message = _condition(pod, "PodScheduled")["message"]
    assert f"Insufficient {GPU_RESOURCE}" in message, message
    events = kube.api.get(
        f"/api/v1/namespaces/{namespace}/events",
        fieldSelector=f"involvedObject.name={pod['metadata']['name']},reason=FailedScheduling",
    )["items"]
    assert events, "the scheduler records a FailedScheduling event"


def test_pod_without_gpus_lands_on_the_cpu_node(
    kube: KubeUnderTest, own_cluster: Cluster, namespace: str
) -> None:
    cluster = own_cluster
    _, cpu_nodes = cluster.node_names()
    pod = {"apiVersion": "v1", "kind": "Pod", **_pod_template({"app": "plain"}, None)}
    pod["metadata"]["name"] = "plain"
    kube.api.create(f"/api/v1/namespaces/{namespace}/pods", pod)
    pod = kube.api.wait_for(
        "the pod scheduled",
        lambda: (
            (p := kube.api.get(f"/api/v1/namespaces/{namespace}/pods/plain"))["spec"].get(
                "nodeName"
            )
            and p
        ),
        timeout_s=TIMEOUT_S,
    )
    assert pod["spec"]["nodeName"] in cpu_nodes
    assert not any(t.get("key") == GPU_RESOURCE for t in pod["spec"].get("tolerations", []))
