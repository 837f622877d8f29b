"""The simulated nodes: pure builders of the Node objects and kwok's Node stages; when one is Ready.

GPU nodes advertise ``nvidia.com/gpu``, carry the labels GPU feature discovery writes
(``nvidia.com/gpu.product``, ``.memory``, ``.count``) and the ``nvidia.com/gpu:NoSchedule``
taint of managed GPU node pools; CPU nodes are untainted. Every node's CPU and memory is
this machine's, shared out evenly, so requests and limits mean something. kwok keeps the
nodes Ready (conditions, leases) and, having no pod stages, does nothing to pods.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

GPU_RESOURCE = "nvidia.com/gpu"
KWOK_ANNOTATION = "kwok.x-k8s.io/node"
"""Nodes carrying ``kwok.x-k8s.io/node: fake`` are the ones kwok manages."""
POOL_LABEL = "conveyor.dev/node-pool"


@dataclass(frozen=True)
class MachineShare:
    """One node's share of this machine."""

    cpu_millis: int
    memory_bytes: int

    @classmethod
    def of_this_machine(cls, nodes: int) -> MachineShare:
        """This machine's CPUs and memory divided evenly among ``nodes``."""
        cpus = len(os.sched_getaffinity(0))
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return cls(cpu_millis=cpus * 1000 // nodes, memory_bytes=memory // nodes)


def node_names(gpu_nodes: int, cpu_nodes: int) -> tuple[list[str], list[str]]:
    """Names of the GPU nodes and the CPU nodes."""
    return [f"gpu-node-{i}" for i in range(gpu_nodes)], [f"cpu-node-{i}" for i in range(cpu_nodes)]


def node_labels(*, gpus: int, gpu_product: str = "", gpu_memory_mib: int = 0) -> dict[str, str]:
    """The labels of a node's pool and GPUs: the simulated nodes carry them (``node_manifest``)
    and a real kubelet registers its node with them (``--node-labels``)."""
    labels = {POOL_LABEL: "gpu" if gpus else "cpu"}
    if gpus:
        labels |= {
            f"{GPU_RESOURCE}.present": "true",
            f"{GPU_RESOURCE}.product": gpu_product,
            f"{GPU_RESOURCE}.memory": str(gpu_memory_mib),
            f"{GPU_RESOURCE}.count": str(gpus),
        }
    return labels


def node_manifest(
    name: str,
    *,
    share: MachineShare,
    address: str,
    kubelet_port: int,
    max_pods: int,
    gpus: int = 0,
    gpu_product: str = "",
    gpu_memory_mib: int = 0,
    kubernetes_version: str = "",
) -> dict:
    """A Node object with its status (a Node's status is kept on create, as a kubelet registers)."""
    labels = {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "type": "kwok",
        **node_labels(gpus=gpus, gpu_product=gpu_product, gpu_memory_mib=gpu_memory_mib),
    }
    resources = {
        "cpu": f"{share.cpu_millis}m",
        "memory": str(share.memory_bytes),
        "pods": str(max_pods),
        "ephemeral-storage": str(100 * 2**30),
    }
    taints = []
    if gpus:
        resources[GPU_RESOURCE] = str(gpus)
        taints.append({"key": GPU_RESOURCE, "effect": "NoSchedule"})
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": labels,
            "annotations": {KWOK_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
        },
        "spec": {"taints": taints} if taints else {},
        "status": {
            "capacity": resources,
            "allocatable": resources,
            "addresses": [
                {"type": "InternalIP", "address": address},
                {"type": "Hostname", "address": name},
            ],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": kubelet_port}},
            "nodeInfo": {
                "architecture": "amd64",
                "operatingSystem": "linux",
                "kubeletVersion": kubernetes_version,
                "kubeProxyVersion": kubernetes_version,
                "containerRuntimeVersion": "conveyor://simulated",
                "kernelVersion": os.uname().release,
                "osImage": "conveyor one-machine cluster",
                "bootID": "",
                "machineID": "",
                "systemUUID": "",
            },
        },
    }


# The conditions of a healthy node, refreshed by both stages.
_CONDITIONS = """
{{ $now := Now }}
conditions:
- type: Ready
  status: "True"
  reason: KubeletReady
  message: "kwok keeps this simulated node ready"
  lastHeartbeatTime: {{ $now | Quote }}
  lastTransitionTime: {{ $now | Quote }}
{{ range $t := list "MemoryPressure" "DiskPressure" "PIDPressure" "NetworkUnavailable" }}
- type: {{ $t }}
  status: "False"
  reason: {{ printf "No%s" $t | Quote }}
  message: "simulated"
  lastHeartbeatTime: {{ $now | Quote }}
  lastTransitionTime: {{ $now | Quote }}
{{ end }}
phase: Running
"""


def node_ready(node: dict[str, Any]) -> bool:
    """Ready, and the node lifecycle controller has lifted its not-ready taints (until then the
    scheduler would leave pods Pending)."""
    conditions = node["status"].get("conditions", [])
    taints = node["spec"].get("taints", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions) and not any(
        t["key"].startswith("node.kubernetes.io/") for t in taints
    )


def kwok_stages(heartbeat_s: int = 30) -> list[dict]:
    """kwok Stage objects for Nodes only: make a node Ready, then keep its conditions fresh.

    With no Pod stages kwok leaves pods alone (the node agent runs them). Liveness itself
    comes from the node leases kwok renews (``--node-lease-duration-seconds``).
    """
    heartbeat_ms = heartbeat_s * 1000
    delay = {
        "durationMilliseconds": heartbeat_ms,
        "jitterDurationMilliseconds": heartbeat_ms + 5000,
    }
    return [
        _node_stage("conveyor-node-ready", ready="NotIn"),
        _node_stage("conveyor-node-heartbeat", ready="In", delay=delay),
    ]


def _node_stage(name: str, *, ready: str, delay: dict[str, int] | None = None) -> dict[str, Any]:
    """A kwok Stage that writes the simulated conditions to Nodes whose Ready condition is
    (``ready="In"``) or is not (``"NotIn"``) True, after ``delay``."""
    ready_is_true = {
        "key": '.status.conditions.[] | select( .type == "Ready" ) | .status',
        "operator": ready,
        "values": ["True"],
    }
    spec: dict[str, Any] = {
        "resourceRef": {"apiGroup": "v1", "kind": "Node"},
        "selector": {"matchExpressions": [ready_is_true]},
    }
    if delay is not None:
        spec["delay"] = delay
    spec["next"] = {"statusTemplate": _CONDITIONS}
    return {
        "apiVersion": "kwok.x-k8s.io/v1alpha1",
        "kind": "Stage",
        "metadata": {"name": name},
        "spec": spec,
    }
